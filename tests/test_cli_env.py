import json

from xstage.cli import main


def test_env_json_reports_versions(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    import torch

    assert info["torch"] == torch.__version__
    import triton

    assert info["triton"] == triton.__version__
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert info["gpus"] == gpus and isinstance(info["sm_count"], int)
    expected_sms = torch.cuda.get_device_properties(0).multi_processor_count if gpus else 0
    assert info["sm_count"] == expected_sms
    assert info["peer_access"] == [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(gpus)]
                                   for i in range(gpus)]


def test_no_command_prints_help(capsys):
    assert main([]) == 1
    assert "usage" in capsys.readouterr().out
