"""`python -m client models fetch --to DIR` and `python -m client models check DIR`.

fetch: the files the stages read, from the Hugging Face Hub (`huggingface_hub`; HF_ENDPOINT and HF_TOKEN as the
library reads them), into DIR in the ComfyUI layout the stages search (docs/checkpoints.md):

    DIR/diffusion_models/minimax_h3_fl2va_pruned_int8_convrot.safetensors     DiT (--dit picks the variant)
    DIR/text_encoders/qwen3vl_32b_minimax_h3_int8_convrot.safetensors         text encoder (--text-encoder)
    DIR/text_encoders/tokenizer.json                                          its tokenizer (the release's)
    DIR/vae/minimax_h3_video_vae_fp16.safetensors, minimax_h3_audio_vae_fp32.safetensors   (--video-vae int8: the
        ComfyUI int8 ConvRot video VAE instead)
    DIR/loras/minimax_h3_*_turbo_*_comfyui_bf16.safetensors                      --lora NAME: LightX2V Turbo LoRAs

1. the size and sha256 of every file from the Hub's headers; files already there with that size and checksum are
   kept (a `.sha256` note beside each saves hashing it again);
2. the free disk space under DIR against what is left to download, before any byte is fetched;
3. each file downloads into `.<name>.part` beside its place, with a progress bar; a run that stopped (Ctrl-C, a lost
   connection) resumes from the bytes there with an HTTP range request;
4. the sha256 of the whole file against the Hub's before it is renamed into place; a mismatch deletes the part.

check: every file's header with the stages' own loaders (no GPU, no weights read), per stage: the file the stage
will use, its variant and size, what is missing or wrong, and whether it is the release file its name claims (its
config's shapes and its variant against the release's: a tiny test model under a release name is "OTHER", with what
differs); then the `scripts/up.sh` line that fits this machine. Exit 0 only when every part reads correctly and is
the release's; 1 otherwise.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from client.checks import add_set_flag
from client.command import self_command
from minimax_h3.files import COMFY_REPO, MODEL_FILES, TURBO_LORAS, VIDEO_VAE_FILES
from stagekit.errors import FailedPrecondition
from stagekit.file_identity import FileIdentity

RELEASE_REPO = "MiniMax-AI/MiniMax-H3"
DISK_MARGIN = 1 << 30  # left free after the download


@dataclass(frozen=True)
class RemoteFile:
    repo: str
    path: str          # in the repository; also the path under DIR, but for the tokenizer
    local: str         # path under DIR

    @property
    def name(self) -> str:
        return Path(self.local).name


DIT_VARIANTS = {  # --dit: the partition (fl2va: text/first/last frame; ref2va: references) and the AdaLN form
    "fl2va-pruned": "minimax_h3_fl2va_pruned_int8_convrot.safetensors",
    "fl2va": "minimax_h3_fl2va_int8_convrot.safetensors",
    "ref2va-pruned": "minimax_h3_ref2va_pruned_int8_convrot.safetensors",
    "ref2va": "minimax_h3_ref2va_int8_convrot.safetensors",
}
TEXT_ENCODER_VARIANTS = {
    "int8": "qwen3vl_32b_minimax_h3_int8_convrot.safetensors",
    "nvfp4": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
    "bf16": "qwen3vl_32b_minimax_h3_bf16.safetensors",
}
AUDIO_VAE_FILE = "vae/minimax_h3_audio_vae_fp32.safetensors"


def wanted_files(dit: str, text_encoder: str, video_vae: str = "fp16", loras: tuple[str, ...] = ()) -> list[RemoteFile]:
    files = [RemoteFile(COMFY_REPO, f"diffusion_models/{DIT_VARIANTS[dit]}", f"diffusion_models/{DIT_VARIANTS[dit]}"),
             RemoteFile(COMFY_REPO, f"text_encoders/{TEXT_ENCODER_VARIANTS[text_encoder]}",
                        f"text_encoders/{TEXT_ENCODER_VARIANTS[text_encoder]}"),
             RemoteFile(RELEASE_REPO, "tokenizer/tokenizer.json", "text_encoders/tokenizer.json")]
    published = [MODEL_FILES[name] for name, _ in [VIDEO_VAE_FILES[video_vae], *(TURBO_LORAS[n] for n in
                                                                                 dict.fromkeys(loras))]]
    return (files + [RemoteFile(COMFY_REPO, AUDIO_VAE_FILE, AUDIO_VAE_FILE)]
            + [RemoteFile(f.repo, f.repo_path, f"{f.folder}/{f.name}") for f in published])


class FetchError(FailedPrecondition):
    """A fetch that cannot go on (the network, the Hub, the disk of this machine: its user fixes them); `str(e)`
    says why and what to do."""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def sha256_of(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stamp(sha: str, path: Path) -> str:
    """The `.sha256` note's line: the checksum and the identity of the file it was taken of."""
    i = FileIdentity.of(path.stat())
    return f"{sha} {i.size} {i.mtime_ns} {i.dev} {i.ino} {i.ctime_ns}"


def _verified(path: Path, size: int, sha: str) -> bool:
    """`path` is complete: its size, and its sha256 (from the `.sha256` note written for this very file, else hashed
    now: the note names the file's `FileIdentity`, so a file put back with the old size and mtime is hashed again)."""
    if not path.is_file() or path.stat().st_size != size:
        return False
    note = path.with_name(f".{path.name}.sha256")
    stamp = _stamp(sha, path)
    if note.is_file() and note.read_text().strip() == stamp:
        return True
    if sha256_of(path) != sha:
        return False
    note.write_text(stamp + "\n")
    return True


def _make_dirs(path: Path, made: list[Path]) -> None:
    """`path.mkdir(parents=True)`, adding each folder it creates to `made` (outermost first)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    made += reversed(missing)


def fetch(to: Path, files: list[RemoteFile], out=sys.stderr) -> int:
    """Steps 1-4 of the module docstring. Returns the number of files downloaded; FetchError when it cannot go on.
    A run that stops removes the folders it created and left empty (a `.part` to resume from keeps its folder; a
    folder that was there before is never removed)."""
    made: list[Path] = []
    try:
        return _fetch(to, files, out, made)
    except BaseException:
        for d in reversed(made):  # innermost first; rmdir removes only an empty folder
            try:
                d.rmdir()
            except OSError:
                pass
        raise


def _fetch(to: Path, files: list[RemoteFile], out, made: list[Path]) -> int:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    _make_dirs(to, made)
    plan = []  # 1. what is where, and how big
    for f in files:
        url = hf_hub_url(f.repo, f.path)
        try:
            meta = get_hf_file_metadata(url)
        except (EntryNotFoundError, RepositoryNotFoundError):
            raise FetchError(f"{f.repo}/{f.path} is not on {constants.ENDPOINT}; another variant may be (see "
                             "models fetch --help), or the repository moved") from None
        except Exception as e:  # noqa: BLE001 -- HTTP errors and the HTTP library's own connection errors alike
            raise FetchError(f"cannot reach {constants.ENDPOINT} for {f.repo}/{f.path}: {e}. Check the network "
                             "(HF_ENDPOINT for a mirror, HF_TOKEN for a gated repository)") from None
        if meta.size is None or not meta.etag or len(meta.etag) != 64:
            raise FetchError(f"{url}: the server gave no size or sha256 for it, so it cannot be checked")
        plan.append((f, url, meta.size, meta.etag))
    todo, have = [], 0
    for f, url, size, sha in plan:
        dest = to / f.local
        if _verified(dest, size, sha):
            print(f"have {f.local} ({_gib(size)}, sha256 ok)", file=out)
            continue
        part = dest.with_name(f".{dest.name}.part")
        have += min(part.stat().st_size, size) if part.is_file() else 0
        todo.append((f, url, size, sha))
    need = sum(t[2] for t in todo) - have
    free = os.statvfs(to).f_bavail * os.statvfs(to).f_frsize  # 2. the disk first
    if need + DISK_MARGIN > free:
        raise FetchError(f"{to} has {_gib(free)} free; the download needs {_gib(need)} more (+ {_gib(DISK_MARGIN)} "
                         "margin). Free space or choose another --to")
    if todo:
        print(f"downloading {len(todo)} file(s), {_gib(need)} to fetch, {_gib(free)} free under {to}", file=out)
    headers = build_hf_headers()
    for f, url, size, sha in todo:  # 3. resumable, with a progress bar
        dest = to / f.local
        _make_dirs(dest.parent, made)
        part = dest.with_name(f".{dest.name}.part")
        done = part.stat().st_size if part.is_file() else 0
        if done > size:
            part.unlink()
            done = 0
        if done:
            print(f"resuming {f.local} at {_gib(done)} of {_gib(size)}", file=out)
        if done < size:
            try:
                with open(part, "ab") as fh:
                    http_get(url, fh, resume_size=done, headers=headers, expected_size=size,
                             displayed_filename=f.local)
            except Exception as e:  # noqa: BLE001 -- a lost connection, a server error: the part stays for a rerun
                raise FetchError(f"{f.local}: the download stopped ({e}); run the same command again to resume "
                                 f"from the {_gib(part.stat().st_size)} there") from None
        print(f"checking the sha256 of {f.local} ...", file=out)  # 4. the whole file against the Hub's checksum
        got = sha256_of(part)
        if got != sha:
            part.unlink()
            raise FetchError(f"{f.local}: sha256 {got} is not the Hub's {sha}; the partial file was deleted, run "
                             "the same command again")
        part.replace(dest)
        dest.with_name(f".{dest.name}.sha256").write_text(_stamp(sha, dest) + "\n")
    return len(todo)


def graph_remote_files(path: str, sets=()) -> list[RemoteFile]:
    """The files a ComfyUI graph loads (its run: the files of a switch's branch not taken are not), where each is
    published (minimax_h3.files.MODEL_FILES), into the folder ComfyUI keeps it in; the text encoder's tokenizer
    beside it. Each file this product does not load is named on stderr with why (it is fetched all the same: the
    graph names it). FetchError for a graph that cannot be read or a file of unknown origin."""
    from minimax_h3.comfy.workflow import edited_graph, graph_problems
    from minimax_h3.files import MODEL_FILES
    from stagekit.errors import InvalidArgument

    try:
        render, problems = graph_problems(edited_graph(Path(path).read_bytes(), sets))
    except OSError as e:
        raise FetchError(f"cannot read --workflow {path}: {e.strerror or e}") from None
    except InvalidArgument as e:
        raise FetchError(f"--workflow {path}: {e.message}") from None
    if render is None:
        raise FetchError(f"--workflow {path} loads no model this product can tell: "
                         + "; ".join(str(p) for p in problems))
    out: list[RemoteFile] = []
    for use in render.files:
        known = MODEL_FILES.get(use.name.value)
        if known is None:
            raise FetchError(f"{use.name.value} ({use.type} node {use.node}) is not a file this product knows where to "
                             "download; put it in the models folder yourself")
        if known.refusal:
            print(f"note: {known.name}: {known.refusal}", file=sys.stderr)
        f = RemoteFile(known.repo, known.repo_path, f"{known.folder}/{known.name}")
        if f not in out:
            out.append(f)
        if known.role == "text_encoder":
            out.append(RemoteFile(RELEASE_REPO, "tokenizer/tokenizer.json", f"{known.folder}/tokenizer.json"))
    for p in problems:
        print(f"note: the graph as written cannot run here: {p}", file=sys.stderr)
    return out


def cmd_fetch(args) -> int:
    try:
        files = (graph_remote_files(args.workflow, args.set or ()) if args.workflow
                 else wanted_files(args.dit, args.text_encoder, args.video_vae, tuple(args.lora or ())))
        n = fetch(Path(args.to).expanduser(), files)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"error: {e}; run the same command again to resume", file=sys.stderr)
        return 1
    print(f"{n} file(s) downloaded; all {len(files)} in {args.to} match the Hub's sha256. Next: "
          f"{self_command()} models check {args.to}")
    return 0


# ---- check ------------------------------------------------------------------------------------------------------


@dataclass
class PartReport:
    stage: str
    part: str
    path: Path | None = None
    variant: str = ""
    size: int = 0
    problem: str = ""      # missing, or a file its stage would refuse
    not_release: str = ""  # read correctly, but not the release file its name or place claims (what differs)


# The DiT / VAE config fields that fix tensor shapes (or the model's arithmetic) and so tell the release model from
# another one, such as the embedded tiny test model written under the release's file names.
DIT_RELEASE_FIELDS = ("hidden", "num_layers", "num_refiner_layers", "num_heads", "head_dim", "ffn", "text_dim",
                      "in_channels", "audio_in_channels", "patch", "freq_dim", "time_embed_hidden", "time_embed_dim",
                      "rope_freq_dim", "rope_theta")
DIT_CURVE_FIELDS = ("adaln_curve_grid", "adaln_curve_rank")
VIDEO_VAE_RELEASE_FIELDS = ("in_channels", "out_channels", "latent_channels", "ch", "ch_mult", "num_res_blocks",
                            "space_down", "time_down", "norm_groups", "dec_layers", "dec_heads", "dec_head_dim",
                            "dec_registers", "dec_ffn_mult")
AUDIO_VAE_RELEASE_FIELDS = ("latent_dim", "latent_channels", "num_attention_heads", "decoder_dim", "decoder_rates",
                            "resblock_kernel_sizes", "resblock_dilation_sizes", "sample_rate")
MAX_DIFFS_NAMED = 4


def _release_diff(what: str, got, release, fields: tuple[str, ...]) -> str:
    """'' when `got` has the release config's value in every field, else what it is instead of the release model:
    "a tiny test model, not the release fl2va DiT (hidden 64 vs 5376, ...)" -- "tiny" when every differing number
    is smaller than the release's."""
    diffs = [(f, getattr(got, f), getattr(release, f)) for f in fields if getattr(got, f) != getattr(release, f)]
    if not diffs:
        return ""
    smaller = all(isinstance(a, (int, float)) and a < b for _, a, b in diffs)
    named = ", ".join(f"{f} {a} vs {b}" for f, a, b in diffs[:MAX_DIFFS_NAMED])
    more = f", +{len(diffs) - MAX_DIFFS_NAMED} more" if len(diffs) > MAX_DIFFS_NAMED else ""
    return f"{'a tiny test model' if smaller else 'another model'}, not the release {what} ({named}{more})"


def _named_dit_variant(name: str) -> str | None:
    """The DiT variant a ComfyUI file name claims (`minimax_h3_fl2va_pruned_int8_convrot` -> int8_convrot_pruned);
    None when the name claims none."""
    n = name.lower()
    base = next((v for v in ("int8_convrot", "bf16", "fp16", "fp32") if v in n), None)
    if base is None:
        return None
    return f"{base}_pruned" if "pruned" in n else base


def _inspect(part: str, path: Path) -> tuple[str, str]:
    """(the variant read from `path`'s header by the stage's own loader, how it differs from the release file its
    name claims or '' when it does not); raises the loader's CheckpointError / errors."""
    if part in ("dit", "dit_ref2va"):
        from minimax_h3.dit.checkpoint import check_checkpoint, partition_undecided
        from minimax_h3.dit.config import DiTConfig

        info = check_checkpoint(path)
        partition = info.partition.partition
        if partition is None:  # the DiT stage refuses a file it cannot place
            raise partition_undecided(path, info.partition)
        fields = DIT_RELEASE_FIELDS + (DIT_CURVE_FIELDS if info.config.adaln_form == "curve" else ())
        differs = _release_diff(f"{partition} DiT", info.config, DiTConfig.full(), fields)
        named = _named_dit_variant(path.name) if path.is_file() else None
        if not differs and named is not None and named != info.variant.name:
            differs = f"named as the release's {named} file, but holds {info.variant.name} weights"
        return f"{info.variant.name}, {partition}", differs
    if part == "encoder":
        from minimax_h3.text.checkpoint import TextEncoderCheckpoint
        from minimax_h3.text.conditioner import ConditionerConfig, resolve_tokenizer

        ckpt = TextEncoderCheckpoint(path, ConditionerConfig.full())  # the release's shapes, or it raises
        variant = ckpt.info.variant + (" + vision tower" if ckpt.info.has_visual else " (no vision tower: no keyframes)")
        ckpt.close()
        tok = resolve_tokenizer(None, path)
        if tok is None:
            raise FileNotFoundError(f"no tokenizer.json beside {path} (models fetch puts the release's there)")
        if tok.vocab_size > ConditionerConfig.full().vocab_size:
            raise ValueError(f"tokenizer.json beside {path} has {tok.vocab_size} ids, more than the model's "
                             f"{ConditionerConfig.full().vocab_size}: not this model's tokenizer")
        return variant, ""  # read against the release's shapes above: another model is refused there
    if part == "video_vae":
        from minimax_h3.vae.video import VideoVAEConfig, inspect_video_vae

        info = inspect_video_vae(str(path), parts="decoder")
        differs = _release_diff("video VAE", info.cfg, VideoVAEConfig.full(), VIDEO_VAE_RELEASE_FIELDS)
        if not differs and path.is_file() and ("int8_convrot" in path.name) != info.storage.startswith("int8"):
            differs = f"named as the release's {'int8_convrot' if 'int8_convrot' in path.name else 'float'} file, " \
                      f"but holds {info.storage} weights"
        return f"{info.layout} layout, {info.storage}, geometry from the {info.config_source}", differs
    from minimax_h3.vae.audio import AudioVAEConfig, inspect_audio_vae

    info = inspect_audio_vae(path, with_encoder=False)
    return (f"{info.layout} layout, geometry from the {info.config_source}",
            _release_diff("audio VAE", info.cfg, AudioVAEConfig.full(), AUDIO_VAE_RELEASE_FIELDS))


def check_folder(models_dir: Path) -> list[PartReport]:
    """One report per part of the model (minimax_h3.files.CHECKPOINT_PARTS): found how the stage finds it, then
    read with its loader."""
    from client.checks import find_for_client
    from minimax_h3.files import CHECKPOINT_PARTS

    stage_of = {"encoder": "encoder", "dit": "dit", "dit_ref2va": "dit", "video_vae": "decoder",
                "audio_vae": "decoder"}
    reports = []
    for part, spec in CHECKPOINT_PARTS.items():
        r = PartReport(stage_of[part], part)
        try:
            r.path = find_for_client(models_dir, part)
        except FailedPrecondition as e:
            if not (spec.optional and e.message.startswith("no ")):
                r.problem = e.message
                reports.append(r)
            continue
        r.size = sum(p.stat().st_size for p in ([r.path] if r.path.is_file() else r.path.rglob("*")) if p.is_file())
        try:
            r.variant, r.not_release = _inspect(part, r.path)
        except Exception as e:  # noqa: BLE001 -- every loader error is the answer for this part
            r.problem = getattr(e, "message", None) or str(e)
        reports.append(r)
    return reports


# A graph's file, by role, and the part of the model (CHECKPOINT_PARTS) whose stage serves it.
PART_OF_ROLE = {"text_encoder": "encoder", "video_vae": "video_vae", "audio_vae": "audio_vae"}


def graph_paths(paths: list[str]) -> list[Path]:
    """--workflow values: graph files, and a folder's *.json graphs that use MiniMax-H3 (its nodes or files: e.g. the
    H3 templates among all of the templates package's)."""
    out = []
    for p in map(Path, paths):
        out += sorted(g for g in p.glob("*.json") if "minimax" in g.read_text(errors="replace").lower()) \
            if p.is_dir() else [p]
    return out


def check_graph(path: Path, root: Path, reports: list[PartReport]) -> list[str]:
    """Why the graph at `path` cannot run over the models folder `root` (empty: it runs): its refused nodes, and
    each file it loads that is missing, wrong, or not the one its stage would serve from the folder."""
    from minimax_h3.comfy.workflow import edited_graph, graph_problems
    from minimax_h3.files import MODEL_FILES
    from stagekit.errors import InvalidArgument

    try:
        render, problems = graph_problems(edited_graph(path.read_bytes()))
    except (OSError, InvalidArgument) as e:
        return [getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)]
    out = [str(p) for p in problems]
    by_part = {r.part: r for r in reports}
    for use in render.files if render else []:
        name, known = use.name.value, MODEL_FILES.get(use.name.value)
        if known is not None and known.refusal:
            continue  # already a refusal of its node
        if use.role == "lora":
            if not (root / "loras" / name).is_file():
                out.append(f"{name} ({use.type} node {use.node}) is not in {root / 'loras'}")
            continue
        part = ("dit_ref2va" if render.conditioning == "reference_to_video" else "dit") if use.role == "dit" \
            else PART_OF_ROLE.get(use.role)
        r = by_part.get(part)
        folder = known.folder if known else "the models folder"
        if r is None or r.path is None:
            out.append(f"{name} ({use.type} node {use.node}) is missing: put it in {root}/{folder} "
                       f"({self_command()} models fetch --workflow {path} --to {root})")
        elif r.path.name != name:
            out.append(f"{use.type} node {use.node} loads {name}, but the {r.stage} stage would serve {r.path.name} "
                       f"from {root}")
        elif r.problem:
            out.append(f"{name}: {r.problem}")
    return out


def cmd_check(args) -> int:
    from client.machine import SETUP_NAMES, find_gpus, recommend

    root = Path(args.models_dir).expanduser()
    if not root.is_dir():
        print(f"error: {root} is not a folder; fetch the files with: {self_command()} models fetch --to {root}",
              file=sys.stderr)
        return 1
    reports = check_folder(root)
    if args.workflow:  # which graphs run over this folder, instead of the parts' report
        graphs_ok = True
        for path in graph_paths(args.workflow):
            why = check_graph(path, root, reports)
            graphs_ok &= not why
            print(f"graph {path.name}: " + ("runs over this folder" if not why else "cannot run here:\n  "
                                             + "\n  ".join(why)))
        return 0 if graphs_ok else 1
    for r in reports:
        if r.path is None:
            print(f"{r.stage:<8} {r.part:<10} MISSING  {r.problem}")
        elif r.problem:
            print(f"{r.stage:<8} {r.part:<10} BAD      {r.path} ({_gib(r.size)}): {r.problem}")
        elif r.not_release:
            print(f"{r.stage:<8} {r.part:<10} OTHER    {r.path} ({_gib(r.size)}; {r.variant}): {r.not_release}")
        else:
            print(f"{r.stage:<8} {r.part:<10} ok       {r.path} ({_gib(r.size)}; {r.variant})")
    bad = [r for r in reports if r.problem]
    other = [r for r in reports if r.not_release and not r.problem]
    if bad:
        print(f"{len(bad)} of {len(reports)} parts missing or wrong; {self_command()} models fetch --to {root} "
              "downloads what is missing (and replaces a damaged file: delete it first)")
    if other:
        print(f"{len(other)} of {len(reports)} parts are not the MiniMax-H3 release files their names claim: the "
              "stages would serve them, but not the release model's video (a tiny test model's is noise). "
              f"python -m client models fetch --to {root} downloads the release files (move these away first)")
    if bad or other:
        return 1
    gpus, _ = find_gpus()
    setup, line = recommend(gpus, str(root))
    print(f"all {len(reports)} parts read correctly and are the release's. For this machine "
          f"({SETUP_NAMES[setup]}):\n  {line}")
    return 0


def add_parser(sub) -> None:
    m = sub.add_parser("models", help="fetch the model files from the Hugging Face Hub, or check a models folder")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    f = msub.add_parser("fetch", help="download the files the stages read (resumable, checksummed)",
                        description=__doc__.split("\n\n")[1] + "\n\nSteps:\n" + __doc__.split("\n\n")[3],
                        formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    f.add_argument("--to", required=True, metavar="DIR", help="the models folder (then: up.sh --models-dir DIR)")
    f.add_argument("--workflow", metavar="FILE.json",
                   help="fetch exactly the files this ComfyUI graph loads, into ComfyUI's folders (diffusion_models/, "
                        "text_encoders/ + the tokenizer, vae/, loras/) instead of the variants below; a file this "
                        "product does not load is named on stderr with why (docs/workflows.md)")
    add_set_flag(f)
    v = f.add_argument_group("variants")
    v.add_argument("--dit", choices=tuple(DIT_VARIANTS), default="fl2va-pruned",
                   help="DiT: fl2va (text, first/last frame) or ref2va (references; a models folder holding both "
                        "serves both: fetch each into it); -pruned: curve-form AdaLN, about 19.5 GiB instead of 34 GB "
                        "(default: fl2va-pruned)")
    v.add_argument("--text-encoder", choices=tuple(TEXT_ENCODER_VARIANTS), default="int8",
                   help="Qwen3-VL text encoder: int8 (ConvRot, about 25 GiB), nvfp4 (Blackwell), bf16 "
                        "(default: int8)")
    v.add_argument("--video-vae", choices=tuple(VIDEO_VAE_FILES), default="fp16",
                   help=f"video VAE: fp16 ({VIDEO_VAE_FILES['fp16'][1]:.2f} GiB) or ComfyUI's int8 ConvRot "
                        f"file ({VIDEO_VAE_FILES['int8'][1]:.2f} GiB; its decoder linears are dequantised at "
                        "load, about 1 %% weight error; ComfyUI's H3 templates name it) (default: fp16)")
    v.add_argument("--lora", action="append", choices=tuple(TURBO_LORAS), metavar="NAME",
                   help="also fetch a LightX2V Turbo LoRA into loras/ (repeatable): "
                        + ", ".join(f"{k} ({name}, {gib:.2f} GiB)" for k, (name, gib) in TURBO_LORAS.items()))
    f.set_defaults(fn=cmd_fetch)
    c = msub.add_parser("check", help="read every file's header with the stages' loaders (no GPU), say what each "
                                      "stage will use and whether it is the release file its name claims, and the "
                                      "up.sh line for this machine (exit 0 only when all of them are)")
    c.add_argument("models_dir", metavar="DIR")
    c.add_argument("--workflow", action="append", metavar="FILE.json|DIR",
                   help="say instead whether each ComfyUI graph runs over DIR as written, and what keeps it from "
                        "running (repeatable; a folder: its *.json graphs that use MiniMax-H3)")
    c.set_defaults(fn=cmd_check)
