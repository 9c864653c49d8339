"""Text conditioner: parity with transformers' untruncated Qwen3-VL text model, streaming, tokenizer, prompt checks."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

from minimax_h3.text.conditioner import Conditioner, ConditionerConfig
from minimax_h3.text.tiny import (
                                  N_BYTES,
                                  TINY_SPECIAL_TOKENS,
                                  TINY_VOCAB_SIZE,
                                  build_tiny_tokenizer,
                                  ensure_tiny_model,
                                  tiny_weights,
                                  write_tiny_model,
                                  )
from minimax_h3.text.tokenizer import PromptError, TextTokenizer, validate_prompt
from stagekit.errors import FailedPrecondition

PROMPT = "A red fox runs through snow at dawn. <d>Hello there!</d> Ünïcödé 雪."
FULL_LAYERS = 4  # the oracle runs more layers than the conditioner uses (tiny: 2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_te")
    # text-only files (the vision tower has its own tests in test_vision.py): keys/bytes here are the LM's alone
    write_tiny_model(d, variant="fp32", num_layers=FULL_LAYERS, with_visual=False)
    write_tiny_model(d, variant="bf16", with_visual=False)
    return d


@pytest.fixture(scope="module")
def cfg():
    return ConditionerConfig.tiny()


@pytest.fixture(scope="module")
def oracle(cfg):
    """transformers' full (untruncated, 4-layer) text model with the same weights, fp32."""
    w = tiny_weights(cfg, num_layers=FULL_LAYERS)
    m = Qwen3VLTextModel(cfg.hf_text_config(num_layers=FULL_LAYERS)).eval()
    m.load_state_dict({**w, "norm.weight": torch.ones(cfg.hidden_size)}, strict=True)
    return m


def _hf_hidden(model, ids, position_ids=None):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), position_ids=position_ids, output_hidden_states=True)
    return out.hidden_states


def test_parity_with_transformers_hidden_states_k(tiny_dir, cfg, oracle):
    c = Conditioner.load(tiny_dir / "qwen3vl_tiny_minimax_h3_fp32.safetensors", cfg, device="cpu", dtype=torch.float32)
    assert c.info.layers_in_file == FULL_LAYERS and c.info.variant == "fp32"
    ids = c.tokenizer.encode(PROMPT)
    ours = c.encode(PROMPT)
    hs = _hf_hidden(oracle, ids)
    assert ours.shape == (len(ids), cfg.hidden_size) and ours.dtype == torch.float32
    err = (ours - hs[cfg.num_layers][0]).abs().max().item()
    print(f"fp32 parity vs transformers hidden_states[{cfg.num_layers}]: max abs err {err:.3e}")
    assert err <= 1e-5
    # Not any other layer's state (guards an off-by-one in the truncation).
    for k in (cfg.num_layers - 1, cfg.num_layers + 1):
        assert (ours - hs[k][0]).abs().max() > 1e-2


def test_truncated_transformers_forward_is_normed_which_is_why_we_drive_the_loop(cfg, oracle, tiny_dir):
    # A transformers model truncated to 2 layers reports hidden_states[2] AFTER the final norm.
    trunc = Qwen3VLTextModel(cfg.hf_text_config(num_layers=cfg.num_layers)).eval()
    sd = {k: v for k, v in oracle.state_dict().items() if not k.startswith(tuple(f"layers.{i}." for i in range(cfg.num_layers, FULL_LAYERS)))}
    trunc.load_state_dict(sd, strict=True)
    c = Conditioner.load(tiny_dir / "qwen3vl_tiny_minimax_h3_fp32.safetensors", cfg, device="cpu", dtype=torch.float32)
    ids = c.tokenizer.encode(PROMPT)
    ours = c.encode_ids(ids)
    last = _hf_hidden(trunc, ids)[cfg.num_layers][0]
    assert (last - ours).abs().max() > 1e-2
    normed = ours * torch.rsqrt(ours.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    assert torch.allclose(last, normed, atol=1e-5)


def test_mrope_position_ids_seam_matches_transformers(tiny_dir, cfg, oracle):
    c = Conditioner.load(tiny_dir / "qwen3vl_tiny_minimax_h3_fp32.safetensors", cfg, device="cpu", dtype=torch.float32)
    ids = c.tokenizer.encode(PROMPT)
    n = len(ids)
    g = torch.Generator().manual_seed(0)
    pos = torch.stack([torch.arange(n), torch.randint(0, 9, (n,), generator=g), torch.randint(0, 9, (n,), generator=g)])
    ours = c.forward(torch.tensor(ids), position_ids=pos)
    ref = _hf_hidden(oracle, ids, position_ids=pos.view(3, 1, n))[cfg.num_layers][0]
    assert (ours - ref).abs().max().item() <= 1e-5


def test_stream_equals_resident_bitwise(tiny_dir, cfg):
    p = tiny_dir / "qwen3vl_tiny_minimax_h3_bf16.safetensors"
    for dtype in (torch.float32, torch.bfloat16):
        res = Conditioner.load(p, cfg, device="cpu", dtype=dtype, mode="resident").encode(PROMPT)
        for host_cache in (True, False):
            st = Conditioner.load(p, cfg, device="cpu", dtype=dtype, mode="stream", host_cache=host_cache)
            assert torch.equal(st.encode(PROMPT), res), (dtype, host_cache)
            # stream mode never materialises weights in the module itself
            assert all(t.device.type == "meta" for t in st.model.layers.parameters())
        compact = Conditioner.load(p, cfg, device="cpu", dtype=dtype, mode="compact")
        assert torch.equal(compact.encode(PROMPT), res), dtype
        assert compact.device_bytes() == p.stat().st_size - _header_bytes(p)  # the stored tensors, as stored
        assert st.device_bytes() == 0


def _header_bytes(path) -> int:
    import struct

    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_bf16_compute_close_to_fp32(tiny_dir, cfg):
    p = tiny_dir / "qwen3vl_tiny_minimax_h3_bf16.safetensors"
    ref = Conditioner.load(p, cfg, device="cpu", dtype=torch.float32).encode(PROMPT)
    out = Conditioner.load(p, cfg, device="cpu", dtype=torch.bfloat16).encode(PROMPT)
    assert out.dtype == torch.bfloat16
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"bf16 compute vs fp32 compute (same bf16 weights): rel err {rel:.3e}")
    assert rel < 3e-2
    # fp32 compute, bf16 output (ComfyUI's contract: compute fp32, round the conditioning to bf16)
    mixed = Conditioner.load(p, cfg, device="cpu", dtype=torch.float32, out_dtype=torch.bfloat16).encode(PROMPT)
    assert torch.equal(mixed, ref.to(torch.bfloat16))


def test_state_dict_keys_are_comfy_keys(tiny_dir, cfg):
    from safetensors import safe_open

    p = tiny_dir / "qwen3vl_tiny_minimax_h3_bf16.safetensors"
    c = Conditioner.load(p, cfg, device="cpu", dtype=torch.float32)
    with safe_open(str(p), "pt") as f:
        file_keys = set(f.keys())
    assert set(c.state_dict()) == file_keys


def test_close_releases_weights(tiny_dir, cfg):
    for mode in ("resident", "compact", "stream"):
        c = Conditioner.load(tiny_dir / "qwen3vl_tiny_minimax_h3_bf16.safetensors", cfg, device="cpu", mode=mode)
        c.encode("hi")
        c.close()
        assert c.device_bytes() == 0
        with pytest.raises(RuntimeError, match="released"):
            c.encode("hi")


def test_encode_ids_rejects_out_of_range(tiny_dir, cfg):
    c = Conditioner.load(tiny_dir / "qwen3vl_tiny_minimax_h3_bf16.safetensors", cfg, device="cpu")
    with pytest.raises(ValueError, match="token ids must be in"):
        c.encode_ids([1, cfg.vocab_size])
    with pytest.raises(ValueError, match="empty"):
        c.encode_ids([])


def test_model_id_depends_on_weights(tmp_path, cfg):
    a = Conditioner.load(write_tiny_model(tmp_path / "a", variant="bf16"), cfg, device="cpu")
    b = Conditioner.load(write_tiny_model(tmp_path / "b", variant="fp32"), cfg, device="cpu")
    assert a.model_id != b.model_id


def test_config_full_matches_reference():
    c = ConditionerConfig.full()
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (5120, 64, 8, 128, 25600)
    assert (c.num_layers, c.rms_norm_eps, c.vocab_size, c.mrope_section, c.rope_theta) == (50, 1e-6, 151936, (24, 20, 20), 5e6)
    hf = c.hf_text_config()
    assert hf.num_hidden_layers == 50 and hf.rope_parameters["mrope_section"] == [24, 20, 20]
    t = ConditionerConfig.tiny()
    assert (t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim, t.num_layers, t.intermediate_size) == (64, 4, 2, 16, 2, 128)
    assert t.vocab_size == TINY_VOCAB_SIZE


# ---------------------------------------------------------------------------------------------- tokenizer


def test_tiny_tokenizer_is_deterministic_and_byte_level(tmp_path):
    a, b = build_tiny_tokenizer().to_str(), build_tiny_tokenizer().to_str()
    assert a == b
    tok = TextTokenizer.from_file(ensure_tiny_model(tmp_path).parent)
    assert tok.vocab_size == TINY_VOCAB_SIZE == N_BYTES + len(TINY_SPECIAL_TOKENS)
    ids = tok.encode("hé")
    assert len(ids) == 3 and all(i < N_BYTES for i in ids)  # 'h' + 2 UTF-8 bytes of 'é'
    assert tok.decode(ids) == "hé"
    d = tok.encode("<d>hi</d>")
    assert d[0] == tok.token_id("<d>") and d[-1] == tok.token_id("</d>") and len(d) == 4
    assert tok.token_id("<|vision_start|>") == N_BYTES + TINY_SPECIAL_TOKENS.index("<|vision_start|>")


def test_release_special_ids_are_checked(tmp_path):
    tok = build_tiny_tokenizer()
    p = tmp_path / "tokenizer.json"
    tok.save(str(p))
    with pytest.raises(FailedPrecondition, match="vision_start"):  # the file is wrong, not the request
        TextTokenizer.from_file(p, check_release_ids=True)
    assert TextTokenizer.from_file(p).special_ids  # small vocab: test tokenizer, no release-id check


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return TextTokenizer.from_file(tiny_dir)


def test_validate_prompt_ok_str_and_bytes(tok):
    text, ids = validate_prompt("a cat", 10, tok)
    assert text == "a cat" and ids == tok.encode("a cat")
    assert validate_prompt("a cat".encode(), 10, tok) == (text, ids)


@pytest.mark.parametrize("bad", ["", "   \n\t", b""])
def test_validate_prompt_empty(tok, bad):
    with pytest.raises(PromptError) as ei:
        validate_prompt(bad, 10, tok)
    assert isinstance(ei.value, ValueError)
    assert ei.value.token_count == 0 and ei.value.limit == 10 and ei.value.reason == "empty"


def test_validate_prompt_too_long(tok):
    with pytest.raises(PromptError) as ei:
        validate_prompt("x" * 11, 10, tok)
    e = ei.value
    assert (e.token_count, e.limit, e.reason) == (11, 10, "too_long")
    assert "11" in str(e) and "10" in str(e)
    assert validate_prompt("x" * 10, 10, tok)[1] == tok.encode("x" * 10)


@pytest.mark.parametrize("bad", [b"ok \xff\xfe", b"\xc3", "lone \ud800 surrogate"])
def test_validate_prompt_not_utf8(tok, bad):
    with pytest.raises(PromptError) as ei:
        validate_prompt(bad, 10, tok)
    assert ei.value.reason == "not_utf8" and ei.value.token_count is None and "10" in str(ei.value)


def test_validate_prompt_rejects_vision_and_chat_markers(tok):
    for marker in ("<|vision_start|>", "<|image_pad|>", "<|im_start|>"):
        with pytest.raises(PromptError, match="reserved"):
            validate_prompt(f"a {marker} b", 100, tok)
    validate_prompt("<d>dialogue is fine</d>", 100, tok)


def test_tiny_checkpoint_is_real_safetensors_and_deterministic(tmp_path):
    from safetensors import safe_open

    p1 = write_tiny_model(tmp_path / "x", variant="bf16")
    p2 = write_tiny_model(tmp_path / "y", variant="bf16")
    # (not byte-compared: safetensors serialises the metadata map in hash order)
    with safe_open(str(p1), "pt") as f1, safe_open(str(p2), "pt") as f2:
        assert f1.metadata() == f2.metadata() and list(f1.keys()) == list(f2.keys())
        assert all(torch.equal(f1.get_tensor(k), f2.get_tensor(k)) for k in f1.keys())
    with safe_open(str(p1), "pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["minimax_h3_te"])
    assert "model.embed_tokens.weight" in keys and "model.layers.1.mlp.down_proj.weight" in keys
    assert "model.norm.weight" not in keys and meta["num_hidden_layers"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stream_equals_resident(tiny_dir, cfg):
    p = tiny_dir / "qwen3vl_tiny_minimax_h3_bf16.safetensors"
    res = Conditioner.load(p, cfg, device="cuda", dtype=torch.bfloat16).encode(PROMPT)
    st = Conditioner.load(p, cfg, device="cuda", dtype=torch.bfloat16, mode="stream").encode(PROMPT)
    cp = Conditioner.load(p, cfg, device="cuda", dtype=torch.bfloat16, mode="compact").encode(PROMPT)
    assert res.device.type == "cuda" and torch.equal(res, st) and torch.equal(res, cp)
    ref = Conditioner.load(p, cfg, device="cpu", dtype=torch.float32).encode(PROMPT)
    assert ((res.float().cpu() - ref).norm() / ref.norm()).item() < 3e-2
