"""benchmarks/bench_long.py: its DiT part end to end on the CPU (tiny weights: one window vs windows, the rates and
verdicts in the JSON). The product-path parts (15s, 60s, extend) run the same way with --tiny in a few minutes each
(docs/long_video.md, "Measuring"); their machinery is benchmarks/one_card.py's."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dit_part_dry_run(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_long.py"), "--part", "dit", "--tiny",
                        "--models-dir", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work"),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_long_dit.json").read_text())
    d = res["items"]["dit"]
    assert "error" not in d, d
    shapes = d["shapes"]
    assert shapes["15s one window"]["windows"] == "one window of 56 frames (picked)"
    assert shapes["15s windows"]["windows"] == "continuation: 2 windows of 39 frames, overlap 22"
    assert shapes["60s windows"]["windows"] == "continuation: 6 windows of 39 frames, overlap 22"
    assert all(row["dit_s_per_generated_s"] > 0 for row in shapes.values())
    assert set(res["verdicts"]["dit_engine"]) == {"windows15_over_single15",
                                                  "dit_s_per_generated_s_60s_le_1.0x_single15"}
    # no stack runs in this part: the cap is judged on the engine's own samples (none on the CPU: no verdict passes)
    assert "trace_ok" not in res["verdicts"] and set(res["verdicts"]["trace_under_cap"]) == {"max_gib", "cap_gib", "ok"}
