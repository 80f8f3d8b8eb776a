from xstage.cli import main

raise SystemExit(main())
