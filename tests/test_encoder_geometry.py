"""The text encoder's geometry comes from the checkpoint file: a deeper tiny-family file loads with the layer
count its header and keys give, and a file whose keys do not hold the declared layers is refused naming the key."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_svc.engine import EncoderEngine, EncoderEngineConfig
from minimax_h3.text.checkpoint import conditioner_config_for
from minimax_h3.text.config import ConditionerConfig
from minimax_h3.text.tiny import write_tiny_model
from stagekit.checkpoints import CheckpointError, WeightSource, read_header


def engine(path, tmp_path) -> EncoderEngine:
    cfg = EncoderEngineConfig(weights=str(path), models_dir="", cache_dir=tmp_path / "cache", device="cpu",
                              dtype=torch.float32)
    return EncoderEngine(cfg, group=None)


def test_embedded_geometry_unchanged(tmp_path):
    path = write_tiny_model(tmp_path, with_visual=False)
    assert conditioner_config_for(path) == ConditionerConfig.tiny()  # 2 layers: the embedded model's cache key


def test_deeper_tiny_encoder_loads_with_its_layer_count(tmp_path):
    path = write_tiny_model(tmp_path, num_layers=6, used_layers=6, with_visual=False)
    assert conditioner_config_for(path).num_layers == 6
    eng = engine(path, tmp_path)
    assert eng.model_cfg.num_layers == 6 and eng.model_id.endswith(":L6")
    eng.load(WeightSource(eng.weight_files()))
    states = eng.model.encode_ids(eng.check_prompt("a bell far off")[1])
    assert states.shape[-1] == 64 and torch.isfinite(states).all()
    eng.unload()


def test_layer_count_from_keys_without_metadata(tmp_path):
    path = write_tiny_model(tmp_path, num_layers=5, used_layers=5, with_visual=False)
    bare = tmp_path / "bare" / path.name
    bare.parent.mkdir()
    save_file(load_file(str(path)), str(bare))  # no header metadata: the keys decide
    (bare.parent / "tokenizer.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    assert not read_header(bare).metadata.get("minimax_h3_te")
    assert conditioner_config_for(bare).num_layers == 5
    assert engine(bare, tmp_path).model_cfg.num_layers == 5


def test_declared_layer_missing_from_keys_is_refused(tmp_path):
    path = write_tiny_model(tmp_path, num_layers=4, used_layers=4, with_visual=False)
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith("model.layers.2.")}
    meta = dict(read_header(path).metadata)
    save_file(tensors, str(path), metadata=meta)  # declares 4 layers, holds 0, 1, 3
    with pytest.raises(CheckpointError) as e:
        engine(path, tmp_path)
    assert "model.layers.2." in str(e.value) and path.name in str(e.value)
