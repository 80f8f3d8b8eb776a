import json

from xstage.cli import main
from xstage.model import load_default_profile


def test_demo_writes_report_and_plots(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "-o", str(out), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    profile = load_default_profile("host")
    assert payload["profile"]["params"] == json.loads(json.dumps(profile.to_dict()))["params"]
    report = (out / "report.md").read_text()
    for name in ("r0", "c_sm", "drain", "capacity", "t0"):
        assert f"| {name} |" in report
    assert "Held-out error" in report
    for png in payload["plots"]:
        assert (tmp_path / "demo" / png.split("/")[-1]).stat().st_size > 5000
