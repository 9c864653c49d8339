"""What `render` refuses by itself, before asking any stage (or starting a local stack, ~10 s).

The rules are the stages' own, from the same torch-free code (`minimax_h3.contract.validate`,
`minimax_h3.images.admit_keyframe`, `minimax_h3.reference_files`, `minimax_h3.labels`); the messages add what only
the client knows: the file name and the flag it came from. What only the stages can tell (a prompt's token count by the encoder's tokenizer, the
LoRAs the DiT has) the render service asks them at Submit, before the job is stored: a local stack refuses it there
once it has started. Every refusal is a `CheckError`, which the CLI prints as `error: ...` and exits 2, whatever the
input (an empty `--prompt ""` and a blank one alike).
"""

from __future__ import annotations

import os
from pathlib import Path

from client.command import self_command
from stagekit.errors import InvalidArgument


class CheckError(InvalidArgument):
    """An input the client refuses (the command is wrong: the user fixes it); `str(e)` is the message for the
    user."""


def add_set_flag(parser) -> None:
    """`--set`, as the commands that read a ComfyUI graph (`render`, `models fetch`) take it."""
    parser.add_argument("--set", action="append", metavar="NODE.WIDGET=VALUE",
                        help="--workflow: change a widget's value before the graph is read (repeatable), e.g. "
                             "--set 115.megapixels=0.2; inside a subgraph, on the widget the instance shows "
                             "(140.vae_name)")


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    """`--prompt` (as given, even empty: `validate` names the problem) then the non-blank lines of the file: one
    render each."""
    if prompt is None and not prompts_file:
        raise CheckError("give --prompt TEXT or --prompts-file FILE")
    prompts = [] if prompt is None else [prompt]
    if prompts_file:
        try:
            lines = Path(prompts_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckError(f"cannot read --prompts-file {prompts_file}: {getattr(e, 'strerror', None) or e}") from None
        found = [p.strip() for p in lines if p.strip()]
        if not found:
            raise CheckError(f"--prompts-file {prompts_file} has no prompts (one per line)")
        prompts += found
    return prompts


def output_paths(output: str, count: int, overwrite: bool = False) -> list[Path]:
    """Where `count` renders go. A trailing slash or an existing directory means "into this folder" (000.mp4,
    001.mp4, ... in prompt order), and so do several renders; otherwise one render goes to the file named. A file
    that exists already is refused unless `overwrite`."""
    out = Path(output)
    if output.endswith(("/", os.sep)) or out.is_dir() or count > 1:
        if out.exists() and not out.is_dir():
            raise CheckError(f"-o {output}: {count} renders go into a folder, but {output} is a file")
        outs = [out / f"{i:03d}.mp4" for i in range(count)]
    else:
        outs = [out]
    refuse_existing(outs, overwrite)
    return outs


def refuse_existing(paths: list[Path], overwrite: bool) -> None:
    """CheckError naming the files in `paths` that exist already, unless `overwrite`."""
    there = [str(p) for p in paths if p.exists()]
    if there and not overwrite:
        more = f" and {len(there) - 1} more" if len(there) > 1 else ""
        raise CheckError(f"-o: {there[0]}{more} exists already; pass --overwrite to replace, or choose another -o")


def read_keyframe(path: str, flag: str, width: int, height: int) -> bytes:
    """The bytes of a PNG/JPEG keyframe file for a `width` x `height` render, admitted as the stages admit it
    (format and size from the header; nothing decoded)."""
    from minimax_h3.images import admit_keyframe

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckError(f"cannot read {flag} {path}: {e.strerror or e}") from None
    try:
        admit_keyframe(data, width, height)
    except InvalidArgument as e:
        raise CheckError(f"{flag} {path}: {e.message}") from None
    return data


def read_references(specs: list[str], prompts: list[str], frames: int):
    """`--ref [KIND:]PATH` values in order -> Reference messages for a render of `frames` frames: each file read and
    checked as the stages will take it (minimax_h3/reference_files.py: size, header, pixels or first frame, sound up
    to the render's duration), the mix of kinds one the model takes, and every prompt's `<Picture i>` / `<Video k>` /
    `<Audio j>` labels checked against them (minimax_h3/labels.py)."""
    from h3.v1 import common_pb2
    from minimax_h3.contract import check_reference_kinds
    from minimax_h3.labels import EXTENSIONS, check_labels, kind_of
    from minimax_h3.reference_files import check_reference_file

    refs, sound = [], []
    for spec in specs:
        kind, sep, path = spec.partition(":")
        if not sep or kind not in EXTENSIONS:
            kind, path = "", spec
        try:
            kind = kind or kind_of(path)
            data = Path(path).read_bytes()
            found = check_reference_file(kind, data, frames)
        except InvalidArgument as e:
            raise CheckError(f"--ref {spec}: {e.message}") from None
        except OSError as e:
            raise CheckError(f"cannot read --ref {path}: {e.strerror or e}") from None
        refs.append(common_pb2.Reference(kind=kind, data=data, name=Path(path).name))
        sound.append(found.sound)
    try:
        check_reference_kinds([r.kind for r in refs])
        for prompt in prompts:
            check_labels(prompt, [r.kind for r in refs], sound, [r.name for r in refs])
    except InvalidArgument as e:
        raise CheckError(e.message) from None
    return refs


def read_guides(specs: list[str], frames: int, width: int, height: int):
    """`--guide FILE[+FILE]@WHEN` values in order -> Guide messages: an image and / or an audio file (kind from the
    extension), anchored at WHEN, seconds into the video (`1.5`, `1.5s`; negative counts from the end) or a frame as
    `fN` (`f36`, `f-1` the last); each file read and checked as the stages will take it."""
    from h3.v1 import common_pb2
    from minimax_h3.contract import MAX_GUIDES, resolve_guide_frame, seconds_to_frame
    from minimax_h3.images import admit_keyframe
    from minimax_h3.labels import kind_of
    from minimax_h3.reference_files import check_reference_file

    if len(specs) > MAX_GUIDES:
        raise CheckError(f"{len(specs)} --guide; a render takes at most {MAX_GUIDES}")
    guides = []
    for spec in specs:
        files, at, when = spec.rpartition("@")
        try:
            if not at or not files:
                raise ValueError
            frame = int(when[1:]) if when.startswith("f") else seconds_to_frame(float(when.removesuffix("s")))
        except ValueError:
            raise CheckError(f"--guide {spec}: write FILE[+FILE]@SECONDS (e.g. face.png@1.5) or FILE[+FILE]@fFRAME "
                             "(e.g. face.png+voice.wav@f36)") from None
        guide = common_pb2.Guide(frame=frame)
        try:
            resolve_guide_frame(frame, frames)
            for path in files.split("+"):
                kind = kind_of(path)
                if kind not in ("image", "audio") or guide.HasField(kind):
                    raise InvalidArgument(f"{path}: a guide is one image and / or one audio file, got a {kind} file")
                data = Path(path).read_bytes()
                if kind == "image":
                    admit_keyframe(data, width, height)
                else:
                    check_reference_file(kind, data, frames)
                getattr(guide, kind).CopyFrom(common_pb2.Reference(kind=kind, data=data, name=Path(path).name))
        except InvalidArgument as e:
            raise CheckError(f"--guide {spec}: {e.message}") from None
        except OSError as e:
            raise CheckError(f"--guide {spec}: cannot read {e.filename}: {e.strerror or e}") from None
        guides.append(guide)
    return guides


WEIGHTS_ENV = {"encoder": "H3_ENCODER_WEIGHTS", "dit": "H3_DIT_WEIGHTS", "dit_ref2va": "H3_DIT_WEIGHTS",
               "video_vae": "H3_DECODER_VIDEO_WEIGHTS", "audio_vae": "H3_DECODER_AUDIO_WEIGHTS"}


def find_for_client(models_dir: str | Path, part: str) -> Path:
    """`minimax_h3.files.find_part`, its refusal naming what a client user can set: the stage's env var
    (`H3_DIT_WEIGHTS=FILE`, read by a stage the client or `scripts/up.sh` starts), not the stage's own `--weights`
    flag, which `render`, `doctor` and `up.sh` do not take."""
    from minimax_h3.files import CHECKPOINT_PARTS, find_checkpoint

    c = CHECKPOINT_PARTS[part]
    return find_checkpoint(models_dir, c.patterns, c.what, c.exclude, f"env {WEIGHTS_ENV[part]}=FILE")


def check_for_local_stack(models_dir: str) -> None:
    """What the local stack about to start would refuse at its start, refused now (its start-up costs ~10 s): with
    a `models_dir`, every part of the model findable under it the way its stage looks (minimax_h3.files), unless
    its file is named by the stage's own env var; else one line naming the folder and what was looked for."""
    if not models_dir:
        return
    from minimax_h3.files import CHECKPOINT_PARTS
    from stagekit.errors import FailedPrecondition

    for part, spec in CHECKPOINT_PARTS.items():
        if os.environ.get(WEIGHTS_ENV[part]):
            continue
        try:
            find_for_client(models_dir, part)
        except FailedPrecondition as e:
            if spec.optional and e.message.startswith("no "):
                continue
            raise CheckError(f"--models-dir {models_dir}: {e.message} ({self_command()} models check DIR "
                             "says what each stage needs)") from None


def _serves(st) -> str:
    """What one stage serves, in words, from its Status."""
    if st is None:
        return "did not answer"
    if st.models_dir:
        return st.models_dir
    return "the embedded tiny model" if st.embedded_model else f"files named one by one ({st.weights})"


def _per_stage(served, words) -> str:
    """`words` of every stage, once when they all agree, else stage by stage."""
    said = {name: words(st) for name, st in served}
    if len(set(said.values())) == 1:
        return next(iter(said.values()))
    return "(" + "; ".join(f"{name}: {w}" for name, w in said.items()) + ")"


def check_running_stack(models_dir: str, devices: str, where: str, source: str, served, endpoints_file: str) -> None:
    """`--models-dir` and `--devices` say what a stack started here would serve; a stack that runs already (`where`,
    configured by `source`) keeps what it was started with, so either flag is refused (CheckError, exit 2) unless it
    is what the stack serves, naming what it serves and how to restart it with the flag: a folder that does not exist
    always; a folder other than the one every stage that answers serves from (`served()`: (stage, Status or None));
    any --devices (the stages report rank 0's device alone, so a match cannot be told). An EndpointError (exit 1)
    when no stage says what it serves."""
    from client.endpoints import DEFAULT_ENDPOINTS_FILE, EndpointError

    if not models_dir and not devices:
        return
    if source == endpoints_file:  # started by scripts/up.sh, which wrote the file
        run_dir = Path(endpoints_file).parent
        rd = "" if run_dir == DEFAULT_ENDPOINTS_FILE.parent else f" --run-dir {run_dir}"
        restart = (f"restart it: scripts/down.sh{rd}, then scripts/up.sh{rd} {{flag}} (with the other flags it was "
                   "started with)")
    else:
        restart = "restart its stages with {flag}"
    if models_dir:
        flag = f"--models-dir {models_dir}" + (" (H3_MODELS_DIR)" if os.environ.get("H3_MODELS_DIR") == models_dir
                                               else "")
        folder = Path(models_dir).expanduser()
        if not folder.is_dir():
            raise CheckError(f"{flag}: models dir {folder} does not exist or is not a directory")
    stages = served()
    answered = [(name, st) for name, st in stages if st is not None]
    if not answered:
        raise EndpointError(f"cannot tell what {where} serves: none of its stages answered Status "
                            f"({', '.join(name for name, _ in stages)}); `{self_command()} status` shows them")
    if models_dir and any(st.models_dir != str(folder.resolve()) for _, st in answered):
        raise CheckError(f"{flag}: {where} (from {source}) serves {_per_stage(stages, _serves)}, not "
                         f"{folder.resolve()}; a running stack keeps the files it was started with. Leave "
                         f"--models-dir out to render with what it serves, or "
                         + restart.format(flag=f"--models-dir {folder.resolve()}"))
    if devices:
        def runs_on(st) -> str:
            if st is None:
                return "did not answer"
            return ",".join(st.devices) + (f" (rank 0 of {st.world_size})" if st.world_size > 1 else "")

        raise CheckError(f"--devices {devices}: {where} (from {source}) runs on {_per_stage(stages, runs_on)} and "
                         f"keeps them: --devices is for a stack started here. Leave --devices out to render on it, "
                         f"or " + restart.format(flag=f"--devices {devices}"))


def check_request_files(req) -> list[str]:
    """The files a filled --workflow request carries (the graph's, or its flags'), checked as the render service
    will: keyframes against the render size, references as the stages take them, their mix. CheckError naming the
    slot and the file. Returns the notes on the prompt's labels: a graph's prompt is taken as the graph gives it
    (minimax_h3/labels.py)."""
    from minimax_h3.contract import check_reference_kinds, spec_from_proto
    from minimax_h3.images import admit_keyframe
    from minimax_h3.labels import GRAPH_LABELS_NOTE, label_problems
    from minimax_h3.reference_files import check_reference_file

    spec = spec_from_proto(req.params)
    try:
        for slot in ("first_frame", "last_frame"):
            if getattr(req, slot):
                try:
                    admit_keyframe(getattr(req, slot), spec.width, spec.height)
                except InvalidArgument as e:
                    raise InvalidArgument(f"{slot}: {e.message}") from None
        if req.references:
            kinds = [r.kind for r in req.references]
            check_reference_kinds(kinds)
            sound = []
            for i, r in enumerate(req.references):
                try:
                    sound.append(check_reference_file(r.kind, r.data, spec.frames).sound)
                except InvalidArgument as e:
                    raise InvalidArgument(f"reference {i + 1} ({r.name or r.kind}): {e.message}") from None
            problems = label_problems(spec.prompt, kinds, sound, [r.name for r in req.references])
            return [*problems, GRAPH_LABELS_NOTE] if problems else []
    except InvalidArgument as e:
        raise CheckError(e.message) from None
    return []


def window_prompts(prompts: list[str], timed: list[str]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """A long render's later prompts and their start seconds: `--prompt` given again (spread evenly: no times) or
    `--timed-prompt SECONDS:TEXT` (each from its second)."""
    if timed and len(prompts) > 1:
        raise CheckError("give the later prompts with --prompt (spread evenly) or --timed-prompt SECONDS:TEXT, not both")
    if not timed:
        return tuple(prompts[1:]), ()
    texts, starts = [], []
    for t in timed:
        head, sep, text = t.partition(":")
        try:
            start = float(head)
        except ValueError:
            start = None
        if not sep or start is None:
            raise CheckError(f"--timed-prompt {t[:40]!r}: give SECONDS:TEXT, e.g. 20:the storm breaks")
        texts.append(text)
        starts.append(start)
    return tuple(texts), tuple(starts)
