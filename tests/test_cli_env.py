import json

import pytest

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


@pytest.mark.parametrize("argv, choices", [
    ([], "give a COMMAND, one of env, probe, bench, model, fit, plan, demo"),
    (["plan"], "give a KERNEL, one of moe, ulysses, exchange-costs, layer, layer-grid, attention-costs, calibrate, "
               "validate"),
    (["bench"], "give a GRID, one of ulysses, moe, moe-calls, experts"),
])
def test_a_missing_subcommand_is_a_usage_error(argv, choices, capsys):
    assert main(argv) == 2  # a user error, not exit 1 (an internal error)
    cap = capsys.readouterr()
    prog = " ".join(["xstage", *argv])
    assert cap.out == "" and cap.err == f"{prog}: error: {choices} (see {prog} -h)\n"
