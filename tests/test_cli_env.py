import json

from xstage.cli import main


def test_env_json_reports_versions(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    import torch

    assert info["torch"] == torch.__version__
    assert int(info["sm_count"]) >= 0
    assert isinstance(info["peer_access"], list)


def test_no_command_prints_help(capsys):
    assert main([]) == 1
    assert "usage" in capsys.readouterr().out
