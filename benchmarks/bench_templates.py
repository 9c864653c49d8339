#!/usr/bin/env python
"""ComfyUI's MiniMax-H3 templates (docs/workflows.md) on one H200 held to 22 GiB, full-size random weights in the
templates' own file names, the one-card stack and numerics of benchmarks/one_card.py (whose machinery this is):

    python3 benchmarks/bench_templates.py --json docs/performance_data/templates/bench_templates.json
    .venv/bin/python benchmarks/bench_templates.py --tiny --json /tmp/templates_tiny.json   # CPU, the tiny model

Items, in this order, each started only while it fits --budget-s (480 s; what did not fit is listed in the JSON):
  fasth3     video_fastvideo_fasth3_t2v's DiT alone (FastH3's file, written for the item and removed after it; the
             graph's size, shifts, sampler and VSA): seconds per step with the graph's VSA on every timed step vs
             dense, FASTH3_STEPS steps each; the card right after the load, against --cap-gb.
  weights    the t2v graph's files: the fl2va DiT, the nvfp4 text encoder, the int8 ConvRot video VAE (converted
             from a random fp16 one, kept beside the models folder), the audio VAE, the 8-step Turbo LoRA.
  vae        the int8 ConvRot video VAE vs the fp16 one: load, decode of 960x544x362 (one rank, every unit), peak.
  stack      scripts/up.sh on the card (int8 linears, fp16), the models folder holding exactly those files.
  render:t2v, render:t2v_turbo
             video_minimax_h3_t2v through `client render --workflow`: as shipped (864x480x124, 20 steps), then with
             its Turbo switch on (140.value=true: the LoRA and the graph's Turbo steps); wall time, each stage's
             compute and load, peak GPU memory per stage (NVML trace).
--tiny runs the same items on the CPU with the tiny model (virtual devices, 256x256 sizes, synthetic memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_two_gpu as two  # noqa: E402
from benchmarks import one_card  # noqa: E402
from minimax_h3.comfy import interpret  # noqa: E402  (torch-free)
from minimax_h3.comfy.workflow import edited_graph  # noqa: E402
from minimax_h3.files import TURBO_LORAS, VIDEO_VAE_FILES  # noqa: E402

GIB = 2**30
T2V, FASTH3_T2V = "video_minimax_h3_t2v", "video_fastvideo_fasth3_t2v"
TURBO_SET = "140.value=true"  # the t2v template's Turbo switch (a PrimitiveBoolean promoted on its subgraph)
TURBO_LORA = TURBO_LORAS["fl2v-8step"][0]
FASTH3_FILE = "fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors"
FP16_VAE, INT8_VAE = VIDEO_VAE_FILES["fp16"][0], VIDEO_VAE_FILES["int8"][0]
FASTH3_STEPS = {False: 4, True: 3}  # timed steps per attention (full, tiny); the first of each is a warm-up
VAE_SIZE = {False: (960, 544, 362), True: (256, 256, 22)}
TINY_SIZE = (256, 256, 22)
# Rough seconds on one H200 held to 22 GiB (one_card's rates: int8 linears streamed, fp16; the writes on the GPU).
EST = {"fasth3": 110, "vae": 80, "weights": 180, "stack": 45}
EST_RENDER = {"t2v": 90, "t2v_turbo": 50}
ITEMS = ("fasth3", "weights", "vae", "stack:int8", *(f"render:{k}" for k in EST_RENDER))


def template_path(name: str) -> Path:
    import comfyui_workflow_templates_json as templates

    return Path(templates.__file__).parent / "templates" / f"{name}.json"


def graph_render(name: str, sets=()):
    """What template `name` (with `sets`) renders: minimax_h3.comfy's reading of it."""
    return interpret(edited_graph(template_path(name).read_text(), sets)).result()


# =====================================================================================================================
# Files in the templates' names (a subprocess: --write-weights WHAT)
# =====================================================================================================================
def write_files(what: str, models: Path, files: Path, tiny: bool) -> dict:
    """`fasth3`: FastH3's DiT (VSA gates) in files/; `vae`: a random fp16 video VAE in files/ and its int8 ConvRot
    form in models/; `stack`: those and the rest of the t2v graph's files in models/ (bench_two_gpu's writers)."""
    import torch

    from minimax_h3.dit.config import DiTConfig
    from minimax_h3.dit.tiny_checkpoint import write_random_int8_convrot_checkpoint, write_tiny_checkpoint
    from minimax_h3.vae.video import VideoVAEConfig, write_int8_convrot_video_vae, write_tiny_video_vae

    models.mkdir(parents=True, exist_ok=True)
    files.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    out: dict = {}

    def once(path: Path, write) -> None:
        if not path.exists():
            tmp = path.with_name(f".{path.name}.tmp")
            write(tmp)
            tmp.replace(path)
        out[path.name] = round(path.stat().st_size / GIB, 3)

    if what == "fasth3":
        cfg = (DiTConfig.tiny() if tiny else DiTConfig.full()).replace(vsa_gates=True)
        once(files / FASTH3_FILE, lambda p: write_tiny_checkpoint(cfg, p, "int8_convrot_pruned") if tiny else
             write_random_int8_convrot_checkpoint(cfg, p, device="cuda", quantize=False, pruned=True))
    elif what == "vae":
        cfg = VideoVAEConfig.tiny() if tiny else VideoVAEConfig.full()
        once(files / FP16_VAE, lambda p: write_tiny_video_vae(str(p), cfg, 0, dtype=torch.float16))
        once(models / INT8_VAE, lambda p: write_int8_convrot_video_vae(str(files / FP16_VAE), str(p)))
    else:  # the t2v graph's files, its video VAE included
        out.update(write_files("vae", models, files, tiny))
        out.update(two.write_weights(models, tiny, {"dit", "te", "audio_vae"}))
        dit_cfg = DiTConfig.tiny() if tiny else DiTConfig.full()
        (models / "loras").mkdir(exist_ok=True)
        once(models / "loras" / TURBO_LORA,
             lambda p: two.write_lora(p, dit_cfg, two.LORA_RANK[tiny], "cpu" if tiny else "cuda"))
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


# =====================================================================================================================
# The FastH3 DiT alone (--fasth3-engine) and the video VAEs alone (--vae-decode), each in its own process
# =====================================================================================================================
def _cap(cuda: bool, dev, cap_gb: float) -> None:
    import torch

    if cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * GIB / total), dev)


def fasth3_engine_bench(models: Path, files: Path, cap_gb: float, tiny: bool) -> dict:
    """s/step of the FastH3 t2v graph's DiT with the graph's VSA (on every timed step) vs dense attention; its file
    written first when missing."""
    import torch

    from minimax_h3.contract import TEXT_STATES, RenderSpec

    wrote = write_files("fasth3", models, files, tiny)
    graph = graph_render(FASTH3_T2V)
    sparse = replace(graph.sparse, start_percent=0.0, min_tokens=0 if tiny else graph.sparse.min_tokens)
    eng, cuda, dev, load_s = one_card.loaded_dit_engine(models, tiny, files / FASTH3_FILE)
    load_peak = None
    if cuda:  # the engine loads every block onto the card before a job's placement streams some back
        free, total = torch.cuda.mem_get_info(dev)
        load_peak = {"reserved_gib": round(torch.cuda.max_memory_reserved(dev) / GIB, 3),
                     "device_used_gib": round((total - free) / GIB, 3),
                     "weights_gib": round(eng.weight_bytes() / GIB, 3)}
        cap = int(cap_gb * GIB)
        eng.cfg.memory_cap_bytes, eng.cfg.memory_limit_bytes = cap, cap - GIB
        _cap(cuda, dev, cap_gb)
    w, h, f = TINY_SIZE if tiny else (graph.width.value, graph.height.value, graph.frames.value)
    steps = FASTH3_STEPS[tiny]
    text = torch.randn(8 if tiny else 512, eng.model_cfg.text_dim, generator=torch.Generator().manual_seed(0))
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "weights": wrote, "load_s": load_s,
                 "loaded": load_peak,
                 "size": f"{w}x{h}x{f}", "steps_timed": steps, "vsa_kernel": list(eng._vsa_row()),
                 "graph": {"steps": graph.steps.value, "sampler": graph.sampler.value,
                           "shifts": [graph.video_shift.value, graph.audio_shift.value],
                           "sparse_attention": vars(graph.sparse)},
                 "measured": "the graph's VSA (keep_percent, tiling, gates) on every timed step (start_percent 0; "
                             "the graph itself runs its first 20 % dense) vs dense attention, the first step of each "
                             "a warm-up" + ("; min_tokens 0 (the tiny sequence is below the graph's 12288)"
                                            if tiny else ""),
                 "runs": {}}
    for name, sp in (("dense", None), ("vsa", sparse)):
        spec = RenderSpec(prompt="x", width=w, height=h, frames=f, steps=steps, seed=1, sampler=graph.sampler.value,
                          scheduler=graph.scheduler.value, video_shift=float(graph.video_shift.value),
                          audio_shift=float(graph.audio_shift.value), sparse=sp)
        run = one_card.timed_run(eng, spec, {TEXT_STATES: text}, dev, cuda)
        row = {"sample_s": round(run.wall_s, 2), "step_s": [round(ms / 1000, 3) for ms in run.ctx.step_ms]}
        timed = row["step_s"][1:] or row["step_s"]
        row["step_s_median"] = round(statistics.median(timed), 3)
        if cuda:
            row["peak_reserved_gib"] = run.peaks["peak_reserved_gib"]
        out["runs"][name] = row
    out["vsa_over_dense_step"] = round(out["runs"]["vsa"]["step_s_median"] / out["runs"]["dense"]["step_s_median"], 3)
    return out


def vae_decode_bench(models: Path, files: Path, cap_gb: float, tiny: bool) -> dict:
    """The int8 ConvRot and the fp16 video VAE: load, then one rank decoding every unit of a 960x544x362 latent."""
    import torch

    from benchmarks.bench_decode import run_rank
    from minimax_h3.contract import SAMPLE_OUTPUTS, VIDEO_LATENTS, RenderSpec, tensor_shapes
    from minimax_h3.vae.tiling import plan_decode
    from minimax_h3.vae.video import inspect_video_vae, load_video_vae

    cuda = torch.cuda.is_available() and not tiny
    dev = "cuda:0" if cuda else "cpu"
    _cap(cuda, dev, cap_gb)
    dtype = torch.float16 if cuda else torch.float32
    w, h, f = VAE_SIZE[tiny]
    lat = torch.randn(tensor_shapes(SAMPLE_OUTPUTS, RenderSpec(width=w, height=h, frames=f))[VIDEO_LATENTS],
                      generator=torch.Generator().manual_seed(0))
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "size": f"{w}x{h}x{f}",
                 "dtype": str(dtype).removeprefix("torch."), "files": {}}
    for name, path in (("int8", models / INT8_VAE), ("fp16", files / FP16_VAE)):
        info = inspect_video_vae(str(path), parts="decoder")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        t0 = time.monotonic()
        model = load_video_vae(str(path), info.cfg, dtype, device=dev, parts="decoder")
        if cuda:
            torch.cuda.synchronize()
        load_s = time.monotonic() - t0
        plan = plan_decode(model.cfg, *lat.shape[1:])
        outs, secs, peak, units = run_rank(model, lat, plan, 0, 1, dev, dtype if cuda else None)
        finite = all(bool(torch.isfinite(o).all()) for o in outs.values())
        out["files"][name] = {"file": path.name, "file_gib": round(path.stat().st_size / GIB, 3),
                              "storage": info.storage, "load_s": round(load_s, 2), "decode_s": round(secs, 2),
                              "units": units, "finite": finite,
                              "peak_alloc_gib": None if peak != peak else round(peak, 3)}
        del model, outs
    fi, ff = out["files"]["int8"], out["files"]["fp16"]
    out["int8_over_fp16"] = {"decode_s": round(fi["decode_s"] / ff["decode_s"], 3),
                             "file": round(fi["file_gib"] / ff["file_gib"], 3)}
    return out


# =====================================================================================================================
# The driver
# =====================================================================================================================
class TemplatesBench(one_card.OneCard):
    json_prefix = "bench_templates"

    def __init__(self, args):
        super().__init__(args)
        self.files = self.work / "files"  # beside the models folder: files the stack must not see
        self.results["notes"].append(
            "renders use the bench prompt (--prompt): the random text encoder's byte-level tokenizer counts the "
            "template's own prompt as more tokens than the encoder takes")

    def save(self) -> None:
        path = Path(self.args.json)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str, ensure_ascii=False))
        tmp.replace(path)

    def size(self, label: str) -> tuple[int, int, int]:
        if self.tiny:
            return TINY_SIZE
        g = graph_render(T2V)
        return g.width.value, g.height.value, g.frames.value

    def subprocess_json(self, flag: list[str], name: str, phase: str) -> dict:
        self.sampler.phase = phase
        cmd = [sys.executable, str(Path(__file__).resolve()), *flag, "--models-dir", str(self.models),
               "--files-dir", str(self.files), "--cap-gb", str(self.args.cap_gb), *(["--tiny"] if self.tiny else [])]
        rc, out, err = self.run_cmd(cmd, timeout_s=max(60.0, self.left_s()), name=name, env=self.env("int8"))
        if rc != 0:
            raise RuntimeError(f"{name} failed (rc {rc}): {err}")
        return json.loads(out.strip().splitlines()[-1])

    def run_fasth3(self) -> dict:
        try:
            return self.subprocess_json(["--fasth3-engine"], "fasth3-engine", "free:fasth3")
        finally:
            (self.files / FASTH3_FILE).unlink(missing_ok=True)  # the disk holds it or the stack's files, not both

    def do_weights(self) -> dict:
        return self.subprocess_json(["--write-weights", "stack"], "weights", "setup:weights")

    def template_render(self, key: str) -> dict:
        sets = [TURBO_SET] if key == "t2v_turbo" else []
        graph = graph_render(T2V, sets)
        self.steps = graph.steps.value  # the graph's own steps (--steps passes the same value)
        extra = ["--workflow", str(template_path(T2V)), *(x for s in sets for x in ("--set", s)),
                 "--sampler", graph.sampler.value, "--scheduler", graph.scheduler.value]
        r = self.do_render(key, key, extra)
        r["graph"] = {"steps": graph.steps.value, "loras": [[n.value, s.value] for n, s in graph.loras],
                      "sets": sets}
        return r

    def run_part(self) -> None:
        self.item("fasth3", EST["fasth3"], self.run_fasth3, needs_stack=False)
        need = any(not p.exists() for p in (self.models / two.FILES["dit"], self.models / "loras" / TURBO_LORA,
                                             self.models / INT8_VAE, self.files / FP16_VAE))
        self.item("weights", EST["weights"] if need else 5, self.do_weights, needs_stack=False)
        self.item("vae", EST["vae"], lambda: self.subprocess_json(["--vae-decode"], "vae-decode", "free:vae"),
                  needs_stack=False)
        self.item("stack:int8", EST["stack"], lambda: self.do_stack("int8"), needs_stack=False)
        for key, est in EST_RENDER.items():
            self.item(f"render:{key}", est, lambda key=key: self.template_render(key))

    def verdicts(self) -> dict:
        v = super().verdicts()
        items = self.results["items"]
        base, turbo = items.get("render:t2v", {}), items.get("render:t2v_turbo", {})
        if base.get("rc") == 0 and turbo.get("rc") == 0:
            dit = [r.get("timing", {}).get("stages", {}).get("dit", {}).get("compute_s") for r in (base, turbo)]
            v["turbo_speedup"] = {"wall": round(base["wall_s"] / turbo["wall_s"], 2),
                                  "dit_compute": round(dit[0] / dit[1], 2) if all(dit) else None,
                                  "steps": [base["graph"]["steps"], turbo["graph"]["steps"]]}
        f = items.get("fasth3", {})
        if "vsa_over_dense_step" in f:
            v["fasth3_vsa_over_dense_step"] = f["vsa_over_dense_step"]
        if f.get("loaded"):  # the card after the FastH3 DiT's load, context included, against the cap
            used = f["loaded"]["device_used_gib"]
            v["fasth3_load_under_cap"] = {"device_used_gib": used, "ok": used <= self.args.cap_gb}
        vae = items.get("vae", {})
        if "int8_over_fp16" in vae:
            v["vae_int8_over_fp16"] = vae["int8_over_fp16"]
            v["vae_decodes_finite"] = all(x["finite"] for x in vae["files"].values())
        return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="docs/performance_data/templates/bench_templates.json",
                    help="the results; the log, trace, plot and stage logs go beside it")
    ap.add_argument("--models-dir", default="", help="the t2v graph's files (default /tmp/h3templates[-tiny])")
    ap.add_argument("--files-dir", default="", help=argparse.SUPPRESS)
    one_card.add_run_args(ap, ITEMS)
    ap.set_defaults(budget_s=480.0)
    ap.add_argument("--write-weights", choices=("stack",), help=argparse.SUPPRESS)
    ap.add_argument("--fasth3-engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vae-decode", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models_dir = args.models_dir or f"/tmp/h3templates{'-tiny' if args.tiny else ''}"
    models, files = Path(args.models_dir), Path(args.files_dir)
    for flag, fn in ((args.write_weights, lambda: write_files(args.write_weights, models, files, args.tiny)),
                     (args.fasth3_engine, lambda: fasth3_engine_bench(models, files, args.cap_gb, args.tiny)),
                     (args.vae_decode, lambda: vae_decode_bench(models, files, args.cap_gb, args.tiny))):
        if flag:
            print(json.dumps(fn()), flush=True)
            return 0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    args.out, args.part, args.steps = str(Path(args.json).resolve().parent), "templates", 0
    return two.run(TemplatesBench, args)


if __name__ == "__main__":
    sys.exit(main())
