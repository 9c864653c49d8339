"""Registers, spills and shared memory of minimax_h3/kernels/fp8_rows.py's Triton kernels per launch config, compiled for a
GPU architecture without one (Triton compiles on the CPU; ptxas and cuobjdump ship with its wheel). Occupancy of
these whole-row-in-registers kernels is set by registers per thread: it says how many rows an SM keeps in flight.

    python benchmarks/kernel_registers.py                      # all ops, each op's default sweep, sm_90 (H100/H200)
    python benchmarks/kernel_registers.py --ops swiglu --configs 1x32,1x16 --arch 90

Configs as benchmarks/bench_fp8_rows.py's (ROWSxWARPS). Integer arguments are compiled as a real launch specialises
them at the DiT's widths (pointers, row strides and widths divisible by 16: vectorised loads; unit strides
constant). Prints one line per config: registers per thread, local-memory stack
bytes (spills), dynamic shared memory, and the CTAs (and rows) an SM holds at once by registers, threads and
shared memory (sm_90's limits).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fp8_rows import O_HEAD_DIM, OPS, parse_config  # noqa: E402
from stagekit.config import comma_choices  # noqa: E402

REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
SHARED_PER_SM = 228 * 1024  # sm_90; each CTA also reserves 1 KiB


def kernel_spec(fr, op: str, width: int, block_rows: int, persistent: bool = False):
    """(kernel, signature, constexpr values) of one op's kernel as its launch calls it."""
    common = {"FP8_MAX": fr.FP8_E4M3_MAX, "INV_FP8_MAX": 1.0 / fr.FP8_E4M3_MAX, "SCALE_FLOOR": fr.FP8_SCALE_FLOOR,
              "BLOCK_R": block_rows, "BLOCK_C": fr.triton.next_power_of_2(width)}
    if op.startswith("orows"):  # [H, S, D] O (e4m3; orows-fa3: FA3's bf16), scales [H, 1, 1], shift [H, 1, D]
        sig = {"o8_ptr": "*bf16" if op == "orows-fa3" else "*fp8e4nv", "sc_ptr": "*fp32", "sh_ptr": "*fp32",
               "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "rows": "i32", "C": "i32", "o_s_h": "i32", "o_s_row": "i32",
               "sh_s_h": "i32"}
        return fr._o_rows_fp8_kernel, sig, {**common, "sh_s_d": 1, "D": O_HEAD_DIM, "HAS_SHIFT": True,
                                            "PERSISTENT": persistent}
    if op == "swiglu":
        sig = {"y_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "rows": "i32", "C": "i32", "y_s_row": "i32"}
        return fr._swiglu_fp8_kernel, sig, {**common, "CUDA": True}
    # modulate / addmod (with the residual add: part = out_proj's bf16 rows, gate = an AdaLN column chunk)
    sig = {"x_ptr": "*fp32", "w_ptr": "*bf16", "shift_ptr": "*fp32", "scale_ptr": "*fp32", "r_ptr": "*i64",
           "gate_ptr": "*fp32", "part_ptr": "*bf16" if op == "addmod" else "*fp32", "q_ptr": "*fp8e4nv",
           "qs_ptr": "*fp32", "rows": "i32", "C": "i32", "inv_c": "fp32", "eps": "fp32", "x_s_row": "i32",
           "sh_s_row": "i32", "sc_s_row": "i32", "g_s_row": "i32", "p_s_row": "i32"}
    # a launch specialises unit strides away
    unit_strides = dict.fromkeys(("x_s_c", "w_s", "sh_s_c", "sc_s_c", "r_s", "g_s_c", "p_s_c"), 1)
    del common["BLOCK_C"]  # the modulation kernel holds a row as three tiles (fp8_rows.row_tiles)
    tiles = dict(zip(("T0", "T1", "T2"), fr.row_tiles(width)))
    return fr._modulate_fp8_kernel, sig, {**common, **unit_strides, **tiles, "ADD": op == "addmod",
                                          "PERSISTENT": persistent}


def compile_one(fr, kernel, sig: dict, consts: dict, num_warps: int, arch: int) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    signature = {name: sig.get(name, "constexpr") for name in names}
    divisible = [n for n, t in sig.items() if t.startswith("*") or n in ("C", "y_s_row", "x_s_row", "sh_s_row",
                                                                         "sc_s_row", "g_s_row", "p_s_row", "o_s_h",
                                                                         "o_s_row", "sh_s_h")]
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    compiled = fr.triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                 options={"num_warps": num_warps, "enable_fp_fusion": False})
    cuobjdump = Path(fr.triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    return {"registers": int(found.group(1)), "stack": int(found.group(2)), "shared": compiled.metadata.shared}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="modulate,addmod,swiglu,orows", type=comma_choices(OPS),
                    help=f"comma-separated, of {', '.join(OPS)}")
    ap.add_argument("--configs", default=None, help="ROWSxWARPS,... (default: each op's benchmark sweep)")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100 / H200)")
    args = ap.parse_args()
    from minimax_h3.kernels import fp8_rows as fr

    if fr.triton is None:
        print("kernel_registers.py needs triton (`.venv/bin/pip install --no-deps triton`)", file=sys.stderr)
        return 2
    for op in filter(None, args.ops.split(",")):
        spec = OPS[op]
        for cfg, block_rows, num_warps, per_sm in map(parse_config, (args.configs or spec.configs).split(",")):
            persistent = bool(per_sm and per_sm[0])
            kernel, sig, consts = kernel_spec(fr, op, spec.width, block_rows, persistent)
            r = compile_one(fr, kernel, sig, consts, num_warps, args.arch)
            threads = 32 * num_warps
            per_warp = -(-r["registers"] * 32 // 256) * 256  # registers are allocated per warp in units of 256
            ctas = min(REGISTERS_PER_SM // (per_warp * num_warps), MAX_THREADS_PER_SM // threads,
                       SHARED_PER_SM // (r["shared"] + 1024))
            held = ctas * block_rows * (2 if persistent else 1)  # a persistent CTA holds this block and the next
            print(f"{op:8s} {cfg:8s} {r['registers']:4d} registers/thread {r['stack']:5d} B spilled "
                  f"{r['shared']:7d} B shared -> {ctas} CTAs ({held} rows) per SM", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
