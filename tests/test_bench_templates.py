"""benchmarks/bench_templates.py end to end on the CPU (--tiny: the tiny model, virtual devices): the same items as
its GPU run (FastH3 VSA vs dense, the int8 vs fp16 video VAE decode, the t2v template as shipped vs its Turbo switch
through `client render --workflow` on the one-card stack), their numbers in the JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("comfyui_workflow_templates_json")

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_measures_every_item(tmp_path):
    out = tmp_path / "out" / "templates.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_templates.py"), "--tiny", "--json", str(out),
                        "--models-dir", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    items = res["items"]
    assert not res["skipped"] and not [k for k, v in items.items() if "error" in v], res["skipped"]
    f = items["fasth3"]
    assert f["runs"]["vsa"]["step_s_median"] > 0 and f["runs"]["dense"]["step_s_median"] > 0
    assert f["graph"]["sparse_attention"]["keep_percent"] == 10.0 and f["vsa_kernel"][1] == "reference"
    vae = items["vae"]["files"]
    assert vae["int8"]["storage"] == "int8_convrot" and vae["fp16"]["storage"] == "fp16"
    assert all(v["decode_s"] > 0 and v["finite"] for v in vae.values())
    base, turbo = items["render:t2v"], items["render:t2v_turbo"]
    assert base["graph"] == {"steps": 20, "loras": [], "sets": []}
    assert turbo["graph"]["steps"] == 8 and turbo["graph"]["loras"] == [
        ["minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", 1]]
    for render in (base, turbo):
        assert render["mp4"]["ok"] and render["steps"] == render["graph"]["steps"], render
        assert {"dit", "decoder"} <= set(render["timing"]["stages"])  # (the second reuses the encoded prompt)
        assert "role_peak_gib" in render["memory"]
    assert "encoder" in base["timing"]["stages"]
    v = res["verdicts"]
    assert v["turbo_speedup"]["steps"] == [20, 8] and v["turbo_speedup"]["wall"] > 0
    assert v["vae_decodes_finite"] and v["fasth3_vsa_over_dense_step"] > 0
    assert not (tmp_path / "work" / "files" / "fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors").exists()
