"""H3 text conditioner: Qwen3-VL-32B's language model run to the residual stream after decoder layer 50.

Facts (docs/model.md §6): the DiT is conditioned on ``hidden_states[50]`` of
``Qwen3VLForConditionalGeneration`` -- the residual stream *after* decoder layer 50 (index 49) and
*before* the final RMSNorm, 5120-d, batch 1, no chat template, no special tokens, no padding.

The decoder layers, rotary embedding and embedding table are transformers' own Qwen3-VL modules
(the model is stock Qwen3-VL, so we own only loading and glue).
We build ``Qwen3VLTextModel`` with ``num_hidden_layers = 50`` but do NOT call its ``forward``:

- its ``forward`` always applies ``self.norm`` to the last layer's output, and its
  ``output_hidden_states`` replaces the last entry with that *normed* tensor, so on a truncated
  model ``hidden_states[50]`` would be wrong. We replace ``norm`` by ``Identity`` (no key in the
  state dict, matching the ComfyUI file) and drive the layer loop ourselves;
- driving the loop ourselves is also what the low-memory modes need:
  ``mode="stream"``: each layer's stored weights go host -> device right before it runs, are
  dequantised there and dropped after (small cards);
  ``mode="compact"``: the stored (int8 / nvfp4 / bf16) tensors stay resident on the device and each
  layer is densified to the compute dtype just before it runs (e.g. the 15.7 GB nvfp4 file on a
  22 GB card, or bf16 storage with fp32 compute).
  All three modes run the same kernels on the same dense weights: outputs are bitwise equal.

Parity with the untruncated transformers model (its ``hidden_states[k]``) is tested on a tiny config.
Keyframes (fl2va) and references (ref2va): transformers' Qwen3-VL vision tower (loaded on the first such request)
encodes each image and each video's temporal patches;
:meth:`Conditioner.encode_presentation` places its features in the prompt (``inputs_embeds``, 3-row M-RoPE
``position_ids``, DeepStack ``deepstack_embeds`` at ``visual_pos_mask``) and runs the same layer loop.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel, Qwen3VLTextRotaryEmbedding

from minimax_h3.text.checkpoint import CheckpointInfo, RawParam, TextEncoderCheckpoint, densify
from minimax_h3.text.config import DEFAULT_MAX_PROMPT_TOKENS, ConditionerConfig
from minimax_h3.text.tokenizer import TextTokenizer, validate_prompt
from minimax_h3.text.vision import (Presentation, VisionConfig, VisionItem, build_presentation, preprocess_image,
                                    preprocess_video)
from stagekit.checkpoints import CheckpointError
from stagekit.errors import FailedPrecondition, Internal, InvalidArgument

log = logging.getLogger(__name__)

Mode = Literal["resident", "stream", "compact"]
MODES = ("resident", "stream", "compact")


class Conditioner(nn.Module):
    """Qwen3-VL language model truncated to ``cfg.num_layers``, returning pre-norm states [L, hidden].

    Parameter names == ComfyUI keys (``model.embed_tokens.weight``, ``model.layers.{i}.*``).
    In ``mode="stream"``/``"compact"`` the module's own parameters stay on the meta device; the stored
    weights live on the host / the device and each layer is materialised densely only while it runs.
    """

    def __init__(
        self,
        cfg: ConditionerConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        out_dtype: torch.dtype | None = None,
        mode: Mode = "resident",
        attn_implementation: str = "sdpa",
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.cfg = cfg
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        # bf16 on GPU (what the DiT consumes); fp32 on CPU (tests, and CPUs lack fast bf16 GEMMs).
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.out_dtype = out_dtype or self.dtype
        self.mode = mode
        hf_cfg = cfg.hf_text_config(attn_implementation=attn_implementation)
        with torch.device("meta"):
            self.model = Qwen3VLTextModel(hf_cfg)
        self.model.norm = nn.Identity()  # the conditioning is the residual *before* the final norm
        # Rotary buffers are non-persistent: rebuild them for real (they were created on meta).
        self.model.rotary_emb = Qwen3VLTextRotaryEmbedding(hf_cfg).to(self.device)
        self.visual: nn.Module | None = None  # Qwen3-VL vision tower (fl2va keyframes); None if the file has none
        self.vision_cfg: VisionConfig | None = None
        self._visual_src: Path | None = None  # checkpoint holding `visual.*`, read on first use
        self.tokenizer: TextTokenizer | None = None
        self.info: CheckpointInfo | None = None
        self.max_prompt_tokens = DEFAULT_MAX_PROMPT_TOKENS
        self._host_embed: RawParam | None = None
        self._host_layers: list[dict[str, RawParam]] | None = None
        self._dev_layers: list[dict[str, RawParam]] | None = None
        self._ckpt: TextEncoderCheckpoint | None = None
        self._closed = False

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        path: str | Path,
        cfg: ConditionerConfig | None = None,
        *,
        tokenizer: TextTokenizer | str | Path | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        out_dtype: torch.dtype | None = None,
        mode: Mode = "resident",
        host_cache: bool = True,
        pin_memory: bool | None = None,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    ) -> "Conditioner":
        """Load a checkpoint (ComfyUI single file, release file/shards) and its tokenizer.

        ``tokenizer``: a TextTokenizer, a tokenizer.json path / model dir, or None = ``tokenizer.json``
        next to the checkpoint (or inside it when ``path`` is a directory).
        ``mode="stream"``: ``host_cache=True`` keeps every layer's stored (possibly quantised) tensors in
        host RAM (pinned when the device is CUDA unless ``pin_memory=False``); ``host_cache=False``
        re-reads each layer from the mmap'd file per forward (minimal RAM, relies on the page cache).
        ``mode="compact"``: stored tensors resident on ``device``, densified per layer.
        Quantised weights are dequantised on ``device`` (per layer in stream / compact mode).
        """
        cfg = cfg or ConditionerConfig.full()
        path = Path(path)
        ckpt = TextEncoderCheckpoint(path, cfg)
        self = cls(cfg, device=device, dtype=dtype, out_dtype=out_dtype, mode=mode)
        self.info = ckpt.info
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = resolve_tokenizer(tokenizer, path)
        if self.tokenizer is not None and self.tokenizer.vocab_size > cfg.vocab_size:
            raise CheckpointError(path, f"its tokenizer has {self.tokenizer.vocab_size} ids but the embedding only "
                                        f"{cfg.vocab_size} rows: not this model's tokenizer.json")
        log.info(
            "text encoder %s: layout=%s variant=%s layers used %d of %d in file, mode=%s dtype=%s device=%s",
            path, ckpt.info.layout, ckpt.info.variant, cfg.num_layers, ckpt.info.layers_in_file, mode, self.dtype, self.device,
        )
        # The vision tower is loaded on the first keyframe request (t2va never pays for it).
        self._visual_src = path if ckpt.info.has_visual else None
        if mode == "resident":
            sd = {"embed_tokens.weight": ckpt.read_embed().to(self.device).dense(self.dtype)}
            for i in range(cfg.num_layers):
                for k, raw in ckpt.read_layer(i).items():
                    sd[f"layers.{i}.{k}"] = raw.to(self.device).dense(self.dtype)
            self.model.load_state_dict(sd, strict=True, assign=True)
            ckpt.close()
        elif mode == "compact":
            self._host_embed = ckpt.read_embed().to(self.device)  # "host" = wherever rows() gathers from
            self._dev_layers = [{k: v.to(self.device) for k, v in ckpt.read_layer(i).items()} for i in range(cfg.num_layers)]
            ckpt.close()
        else:
            pin = pin_memory if pin_memory is not None else self.device.type == "cuda"
            self._host_embed = ckpt.read_embed()
            if host_cache:
                layers = [ckpt.read_layer(i) for i in range(cfg.num_layers)]
                if pin:
                    layers = [{k: v.pin_memory() for k, v in layer.items()} for layer in layers]
                self._host_layers = layers
                ckpt.close()
            else:
                self._ckpt = ckpt
        return self

    @property
    def has_vision(self) -> bool:
        return self.visual is not None or self._visual_src is not None

    def _ensure_visual(self) -> None:
        if self.visual is not None:
            return
        if self._closed:
            raise RuntimeError("conditioner weights were released (close() called); load it again")
        if self._visual_src is None:
            raise FailedPrecondition("this text encoder has no vision tower (the checkpoint carries no 'visual.*' "
                                     "weights); keyframe renders need the full Qwen3-VL encoder file")
        ckpt = TextEncoderCheckpoint(self._visual_src, self.cfg)  # validated again: the file may have changed
        try:
            self._load_visual(ckpt)
        finally:
            ckpt.close()

    def _load_visual(self, ckpt: TextEncoderCheckpoint) -> None:
        """Build transformers' Qwen3VLVisionModel with the file's dims (validated when the checkpoint was opened) and
        load its weights (resident, dense, in the compute dtype: ~0.8 GB at full size, small next to the LM)."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel, Qwen3VLVisionRotaryEmbedding

        vcfg = ckpt.info.vision
        hf = vcfg.hf_config()
        with torch.device("meta"):
            visual = Qwen3VLVisionModel(hf)
        visual.load_state_dict({k: v.to(self.device, self.dtype) for k, v in ckpt.read_visual().items()},
                               strict=True, assign=True)
        # Rotary inv_freq buffers are non-persistent: rebuild them for real (they were created on meta).
        visual.rotary_pos_emb = Qwen3VLVisionRotaryEmbedding(hf).to(self.device)
        self.visual = visual.eval().requires_grad_(False)
        self.vision_cfg = vcfg

    @property
    def model_id(self) -> str:
        """Identity of the loaded weights (+ tokenizer) for cache keys."""
        fp = self.info.fingerprint if self.info else "unloaded"
        tok = self.tokenizer.fingerprint if self.tokenizer else "no-tokenizer"
        return f"{fp[:16]}:{tok[:16]}:L{self.cfg.num_layers}"

    def device_bytes(self) -> int:
        """Bytes of weights this conditioner keeps on its device (0 in stream mode, apart from the rotary table)."""
        n = sum(p.numel() * p.element_size() for p in self.parameters() if p.device.type != "meta")
        raws = list(self._dev_layers or [])
        if self.mode == "compact" and self._host_embed is not None:
            raws.append({"embed": self._host_embed})
        return n + sum(rp.nbytes for layer in raws for rp in layer.values())

    def close(self) -> None:
        """Release every weight now (device params go to meta, host copies and the file are dropped),
        even while other references to this object linger. The conditioner is unusable afterwards."""
        self._closed = True
        self.model.to("meta")
        self.visual = None
        self._host_layers = None
        self._dev_layers = None
        self._host_embed = None
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def encode(self, prompt: str | bytes, max_tokens: int | None = None) -> torch.Tensor:
        """Prompt -> [L, hidden] conditioning states (``out_dtype``, on ``device``)."""
        if self.tokenizer is None:
            raise ValueError("no tokenizer loaded: pass tokenizer= to Conditioner.load or call encode_ids")
        _, ids = validate_prompt(prompt, max_tokens or self.max_prompt_tokens, self.tokenizer)
        return self.encode_ids(ids)

    @torch.inference_mode()
    def encode_ids(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise InvalidArgument("cannot encode an empty token sequence")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise InvalidArgument(f"token ids must be in [0, {self.cfg.vocab_size}), got range [{lo}, {hi}]")
        return self.forward(ids).to(self.out_dtype)

    @property
    def temporal_patch(self) -> int:
        """Frames the vision tower takes per video block (the file's patch embedding says)."""
        if self.info is None or self.info.vision is None:
            raise FailedPrecondition("this text encoder has no vision tower (the checkpoint carries no 'visual.*' "
                                     "weights); keyframe and reference renders need the full Qwen3-VL encoder file")
        return self.info.vision.temporal_patch_size

    @torch.inference_mode()
    def encode_presentation(self, prompt_ids: list[int], items: list[VisionItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each item's labels and vision blocks (fl2va keyframes: `vision.keyframe_items`; ref2va references:
        `vision.reference_parts`), then the prompt ids -> (states [L, hidden] ``out_dtype``, DiT tags [L] int64 on
        the CPU)."""
        pres, feats, deepstack = self.vision_inputs(prompt_ids, items)
        h = self._embed(pres.ids)
        mask = pres.vision_mask.to(h.device)
        h = h.clone()
        h[mask] = feats.to(h.device, h.dtype)
        states = self.forward(inputs_embeds=h, position_ids=pres.position_ids, visual_pos_mask=mask,
                              deepstack_embeds=deepstack)
        return states.to(self.out_dtype), pres.tags

    def vision_inputs(self, prompt_ids: list[int], items: list[VisionItem]
                      ) -> tuple[Presentation, torch.Tensor, list[torch.Tensor]]:
        """The presentation plus the vision tower's merged features [n_pads, hidden] and DeepStack features, in
        presentation order (every block of every item: an image one, a video one per temporal patch)."""
        self._ensure_visual()
        if self.tokenizer is None:
            raise FailedPrecondition("no tokenizer loaded: keyframe presentations need one")
        if not items:
            raise InvalidArgument("audio references need at least one image or video reference beside them")
        tok = self.tokenizer
        vcfg = self.vision_cfg
        pads = {"image": tok.token_id("<|image_pad|>"), "video": tok.token_id("<|video_pad|>")}
        pixels, blocks = [], []
        for item in items:
            if item.kind == "image":
                pv, grid = preprocess_image(item.pixels[0], vcfg)
            else:
                pv, grid = preprocess_video(item.pixels, vcfg)
            if int(grid[0]) != len(item.labels):
                raise Internal(f"a {item.kind} of {int(grid[0])} vision blocks has {len(item.labels)} labels")
            pixels.append(pv)
            blocks += [(lab, torch.tensor([1, int(grid[1]), int(grid[2])]), pads[item.kind]) for lab in item.labels]
        # One temporal patch per grid row: the tower attends within each, as it does over a video's grid.
        out = self.visual(torch.cat(pixels).to(self.device, self.dtype),
                          grid_thw=torch.stack([g for _, g, _ in blocks]).to(self.device), return_dict=True)
        pres = build_presentation(blocks, list(prompt_ids), tok.token_id("<|vision_start|>"),
                                  tok.token_id("<|vision_end|>"), vcfg)
        n = sum(int(g.prod()) for _, g, _ in blocks) // vcfg.spatial_merge_size ** 2
        if out.pooler_output.shape[0] != n or int(pres.vision_mask.sum()) != n:
            raise Internal(f"vision tower produced {out.pooler_output.shape[0]} tokens for {n} vision pads")
        if len(out.deepstack_features) > self.cfg.num_layers:
            raise FailedPrecondition(f"the text encoder's vision tower has {len(out.deepstack_features)} DeepStack "
                                     f"levels but the language model only {self.cfg.num_layers} layers: use files "
                                     "of one Qwen3-VL encoder")
        return pres, out.pooler_output, list(out.deepstack_features)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.mode == "resident":
            return self.model.embed_tokens(ids.to(self.device))
        # Gather where the table lives and ship only L rows (an int8 table never needs densifying).
        if self._host_embed is None:
            raise RuntimeError("conditioner weights were released (close() called)")
        src = self._host_embed.tensors["weight"].device
        return self._host_embed.rows(ids.to(src), self.dtype).to(self.device)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        visual_pos_mask: torch.Tensor | None = None,
        deepstack_embeds: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[L] ids (or [L, hidden] embeds) -> [L, hidden] residual after ``cfg.num_layers`` layers.

        ``position_ids``: [3, L] M-RoPE (t, h, w) positions; default = text positions 0..L-1 on all axes.
        ``deepstack_embeds[j]`` is added at ``visual_pos_mask`` after layer j (Qwen3-VL DeepStack seam).
        """
        if self._closed:
            raise RuntimeError("conditioner weights were released (close() called); load it again")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids / inputs_embeds")
        h = self._embed(input_ids.reshape(-1)) if inputs_embeds is None else inputs_embeds.to(self.device, self.dtype)
        h = h.reshape(1, -1, self.cfg.hidden_size)
        n = h.shape[1]
        if position_ids is None:
            text_pos = torch.arange(n, device=self.device).view(1, n)
            mrope_pos = text_pos.view(1, 1, n).expand(3, 1, n)
        else:
            mrope_pos = position_ids.to(self.device).view(3, 1, n)
            text_pos = torch.arange(n, device=self.device).view(1, n)
        pos_emb = self.model.rotary_emb(h, mrope_pos)
        # attention_mask=None -> transformers' SDPA path uses is_causal (batch 1, no padding).
        kwargs = dict(position_embeddings=pos_emb, attention_mask=None, position_ids=text_pos)
        for i, params in self._layer_weights():
            layer = self.model.layers[i]
            if params is None:
                h = layer(h, **kwargs)
            else:
                h = torch.func.functional_call(layer, params, (h,), kwargs)
                del params
            # DeepStack: transformers adds level i after layer i, but records hidden_states[i + 1] *before* that add;
            # the conditioning is hidden_states[num_layers], so the last layer's add (tiny configs only) is skipped.
            if deepstack_embeds is not None and i < len(deepstack_embeds) and i + 1 < self.cfg.num_layers:
                mask = visual_pos_mask.to(self.device).view(1, n)
                h = h.clone()
                h[mask] = h[mask] + deepstack_embeds[i].to(h.device, h.dtype)
        return h[0]  # no final norm, by design

    def _layer_weights(self):
        """Yield (i, params) per layer: params None in resident mode, else freshly materialised dense weights."""
        n = self.cfg.num_layers
        if self.mode == "resident":
            for i in range(n):
                yield i, None
            return
        if self.mode == "compact":
            if self._dev_layers is None:
                raise RuntimeError("conditioner weights were released (close() called)")
            for i in range(n):
                yield i, densify(self._dev_layers[i], self.dtype)
            return
        if self.device.type != "cuda":
            for i in range(n):
                yield i, densify({k: v.to(self.device) for k, v in self._host_raw(i).items()}, self.dtype)
            return
        # CUDA: copy layer i+1 on a side stream while layer i computes.
        compute = torch.cuda.current_stream(self.device)
        copy = torch.cuda.Stream(self.device)

        def issue(i: int):
            raw = self._host_raw(i)
            with torch.cuda.stream(copy):
                moved = {k: v.to(self.device, non_blocking=True) for k, v in raw.items()}
                ev = torch.cuda.Event()
                ev.record(copy)
            return moved, ev

        pending = issue(0)
        for i in range(n):
            moved, ev = pending
            compute.wait_event(ev)
            for rp in moved.values():
                for t in rp.tensors.values():
                    t.record_stream(compute)
            if i + 1 < n:
                pending = issue(i + 1)
            yield i, densify(moved, self.dtype)
            del moved

    def _host_raw(self, i: int) -> dict[str, RawParam]:
        if self._host_layers is not None:
            return self._host_layers[i]
        if self._ckpt is None:
            raise RuntimeError("conditioner weights were released (close() called)")
        return self._ckpt.read_layer(i)


def resolve_tokenizer(tokenizer, ckpt_path: Path) -> TextTokenizer | None:
    """A TextTokenizer from an instance / path, or ``tokenizer.json`` beside (or inside) ``ckpt_path``; None if absent."""
    if isinstance(tokenizer, TextTokenizer):
        return tokenizer
    if tokenizer is not None:
        return TextTokenizer.from_file(tokenizer)
    guess = (ckpt_path if ckpt_path.is_dir() else ckpt_path.parent) / "tokenizer.json"
    if guess.exists():
        return TextTokenizer.from_file(guess)
    log.warning("no tokenizer.json next to %s: encode() needs tokenizer=; encode_ids() works", ckpt_path)
    return None


