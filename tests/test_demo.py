import json

import torch

import xstage.demo as demo
from xstage.cli import main
from xstage.model import load_default_profile
from xstage.spec.schedule import CANDIDATES


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_demo_writes_report_and_plots_and_plans_what_plan_moe_plans(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "-o", str(out), "--json"]) == 0
    cap = capsys.readouterr()
    assert cap.err == ""  # no progress under --json
    payload = _strict_json(cap.out)
    profile = load_default_profile("host")
    assert payload["profile"]["params"] == json.loads(json.dumps(profile.to_dict()))["params"]
    report = (out / "report.md").read_text()
    for name in ("r0", "c_sm", "drain", "capacity", "t0"):
        assert f"| {name} |" in report
    assert "Held-out error" in report
    assert ("This table is what `xstage plan moe --shape H4096-I2048-E256-K6 --tokens 2048 --ep 8 --pacing default` "
            "plans" in report)
    from matplotlib.image import imread

    assert sorted(p.split("/")[-1] for p in payload["plots"]) == ["issue_vs_burst.png", "issue_vs_gap.png",
                                                                   "plan_timeline.png"]
    for png in payload["plots"]:
        img = imread(tmp_path / "demo" / png.split("/")[-1])
        assert img.shape[0] > 300 and img.shape[1] > 400 and img[..., :3].std() > 0.01  # a drawn, non-blank plot

    # The demo's planned table is `xstage plan moe`'s: same schedules, same order, same times.
    argv = ["plan", "moe", "--shape", "H4096-I2048-E256-K6", "--tokens", "2048", "--ep", "8", "--pacing", "default",
            "--json"]
    if torch.cuda.is_available():  # `plan moe` plans for this GPU's SM count, the demo for the profile's
        argv += ["--ctas", str(profile.sm_count)]
    assert main(argv) == 0
    planned = _strict_json(capsys.readouterr().out)
    assert sorted(r["schedule"] for r in payload["plan"]) == sorted(CANDIDATES)
    assert [r["schedule"] for r in payload["plan"]] == [r["schedule"] for r in planned["rows"]]
    assert [r["time_us"] for r in payload["plan"]] == [r["time_us"] for r in planned["rows"]]
    assert payload["plan"][0]["schedule"] == planned["pick"]


def test_demo_refuses_a_file_as_its_output_folder_before_any_work(tmp_path, capsys, monkeypatch):
    existing = tmp_path / "existing.json"
    existing.write_text("{}")
    monkeypatch.setattr(demo, "load_default_profile", lambda *a: (_ for _ in ()).throw(AssertionError("work")))
    assert main(["demo", "-o", str(existing)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.strip().count("\n") == 0
    assert f"-o {existing}" in cap.err and "not a folder" in cap.err
    assert existing.read_text() == "{}"


def test_demo_reports_progress_as_plain_lines_when_redirected(tmp_path, capsys, monkeypatch):
    # A small plan keeps this test short; the steps and the progress lines are the demo's own.
    monkeypatch.setattr(demo, "_PLAN_CONFIG", ("H512-I256-E16-K2", 64, 4))
    assert main(["demo", "-o", str(tmp_path / "d")]) == 0
    cap = capsys.readouterr()
    assert "\r" not in cap.err
    assert "demo: planning the fused MoE kernel" in cap.err
    assert f"demo: MoE schedules simulated: {len(CANDIDATES)}/{len(CANDIDATES)}" in cap.err
    assert "written to" in cap.out and (tmp_path / "d" / "report.md").exists()
