"""Test helpers that write safetensors files byte by byte: full-size inventories as sparse files (holes, no data),
and header edits of real files (the corrupt-file cases)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from stagekit.checkpoints import DTYPE_BYTES, HEADER_LEN_BYTES


def write_sparse_safetensors(path: str | Path, specs: dict[str, tuple], metadata: dict | None = None) -> Path:
    """A real safetensors file whose tensors are holes: `specs` name -> (dtype, shape[, payload bytes or None]);
    only payloads are written, so a 10 GB inventory costs a header."""
    header, offset = {}, 0
    for name, (dtype, shape, *_rest) in specs.items():
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = HEADER_LEN_BYTES + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, (_d, _s, *rest) in specs.items():
            if rest and rest[0] is not None:
                f.seek(start + header[name]["data_offsets"][0])
                f.write(rest[0])
        f.truncate(start + offset)
    return Path(path)


def read_raw_header(path: str | Path) -> tuple[dict, bytes]:
    """(header JSON, data bytes) of a safetensors file."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:HEADER_LEN_BYTES])
    return json.loads(data[HEADER_LEN_BYTES:HEADER_LEN_BYTES + n]), data[HEADER_LEN_BYTES + n:]


def write_raw(path: str | Path, header: dict, body: bytes) -> Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return Path(path)


def edit_header(src: str | Path, dst: str | Path, edit) -> Path:
    """Copy `src` to `dst` with `edit(header)` applied to its JSON header, the data bytes untouched."""
    header, body = read_raw_header(src)
    edit(header)
    return write_raw(dst, header, body)


def rewrite_tensors(src: str | Path, dst: str | Path, edit) -> Path:
    """Copy a safetensors file with `edit(tensors)` applied to its tensors (a dict, changed in place), the metadata
    kept: how the tests make a file whose header is fine and whose data is not (a NaN, a zero std, a bad filter)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst), metadata=metadata)
    return Path(dst)


def write_release_video_vae(path: str | Path, int8: bool) -> Path:
    """The H3 video VAE's full-size inventory, sparse: every tensor fp16, or (`int8`) as ComfyUI's int8 ConvRot file
    stores it: the attention and feed-forward linears of the decoder's 36 blocks int8 [out, in] with an fp32 [out, 1]
    scale and a `comfy_quant` descriptor (ConvRot group 256; the descriptors are the only bytes written)."""
    import re

    import torch

    from minimax_h3.vae.video import VideoVAE, VideoVAEConfig

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in VideoVAE(VideoVAEConfig.full()).state_dict().items()}
    descriptor = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}).encode()
    quantised = re.compile(r"decoder\.transformer_blocks\.\d+\.(attn\.to_qkv|attn\.to_out|ff\.w1|ff\.w2)")
    specs = {}
    for k, shp in shapes.items():
        layer = k[: -len(".weight")]
        if int8 and k.endswith(".weight") and quantised.fullmatch(layer):
            specs[k] = ("I8", shp)
            specs[layer + ".weight_scale"] = ("F32", (shp[0], 1))
            specs[layer + ".comfy_quant"] = ("U8", (len(descriptor),), descriptor)
        else:
            specs[k] = ("F16", shp)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_sparse_safetensors(path, specs)
