"""Step caching (`quality = "fast"`, minimax_h3/dit/step_cache.py): First Block Cache against diffusers' own hook on
the same tiny weights, the sampler's schedule untouched by skipped steps, `exact` the same bits as the plain
forward, and TP / SP ranks taking the same decisions (gloo, real spawned processes)."""

from __future__ import annotations

import pytest
import torch

from minimax_h3.dit.config import DiTConfig
from minimax_h3.dit.convert_diffusers import from_diffusers
from minimax_h3.dit.keyframes import conditioned_denoise
from minimax_h3.dit.layout import build_layout
from minimax_h3.dit.model import H3DiT
from minimax_h3.dit.sampling import SamplerConfig, sample
from minimax_h3.dit.sp import make_groups
from minimax_h3.dit.step_cache import FirstBlockCache
from minimax_h3.dit.tp import shard_state_dict
from tests.dit_ranks import tiny_case
from tests.ranks import run_ranks

STEPS = 12
# Chosen from the distances these seeded runs print (0.03-0.6): several steps skip, several run, and no distance
# lies within 1e-3 of it, so a rounding difference between two implementations cannot flip a decision.
THRESHOLD = 0.2
# Our fp32 model against diffusers' on the same weights: 1e-5 per forward (tests/test_dit_model.py); over 12 steps
# of a sampler that feeds each step's output into the next.
DIFFUSERS_RTOL = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(model, lay, x, cache: FirstBlockCache | None, steps: int = STEPS, sampler: str = "res_multistep"):
    """The sampler over the case's target rows (its conditioning rows fixed): (video, audio, every (t_video,
    t_audio) the model was called at)."""
    video, audio, text = x
    n = lay.num_cond_rows
    denoise = conditioned_denoise(model, text, lay, video[:n] if n else None, step_cache=cache)
    calls = []

    def recorded(xv, xa, tv, ta):
        calls.append((float(tv), float(ta)))
        return denoise(xv, xa, tv, ta)

    with torch.no_grad():
        v, a = sample(recorded, video[n:], audio, SamplerConfig(sampler=sampler, steps=steps))
    return v, a, calls


@pytest.fixture(scope="module")
def case():
    cfg, sd, lay, x = tiny_case()
    model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    model.load_state_dict(sd)
    return cfg, model, lay, x


def test_skipped_steps_keep_the_schedule_and_exact_is_the_plain_forward(case):
    """A fast run calls the model at every step of the same schedule as an exact one, and skips some steps; with
    threshold 0 the cache runs every block and gives the exact bits; without a cache the forward is the plain one."""
    cfg, model, lay, x = case
    v_exact, a_exact, t_exact = run(model, lay, x, None)
    plain = conditioned_denoise(model, x[2], lay, x[0][:lay.num_cond_rows])  # the closure as it was before caching
    with torch.no_grad():
        v_plain, a_plain = sample(plain, x[0][lay.num_cond_rows:], x[1], SamplerConfig(steps=STEPS))
    assert torch.equal(v_exact, v_plain) and torch.equal(a_exact, a_plain)

    cache = FirstBlockCache(THRESHOLD)
    v_fast, a_fast, t_fast = run(model, lay, x, cache)
    print("distances", [f"{d:.4f}" for d in cache.distances], "skipped", cache.skipped)
    assert t_fast == t_exact and len(t_fast) == STEPS  # one call per step, at the same t
    assert len(cache.skipped) == STEPS and not cache.skipped[0]
    assert 0 < cache.cached_steps < STEPS - 1
    assert all(abs(d - THRESHOLD) > 1e-3 for d in cache.distances)
    assert not torch.equal(v_fast, v_exact) and rel(v_fast, v_exact) < 0.5

    never = FirstBlockCache(0.0)
    v0, a0, _ = run(model, lay, x, never)
    assert never.cached_steps == 0 and torch.equal(v0, v_exact) and torch.equal(a0, a_exact)


def test_euler_schedule_is_unchanged_too(case):
    _, model, lay, x = case
    _, _, t_exact = run(model, lay, x, None, steps=6, sampler="euler")
    cache = FirstBlockCache(1e9)  # every step after the first reuses the tail
    _, _, t_fast = run(model, lay, x, cache, steps=6, sampler="euler")
    assert t_fast == t_exact and cache.skipped == [False] + [True] * 5


def test_a_cached_step_adds_the_last_full_steps_tail_residual():
    """Blocks 1.. run only at full steps; at a cached step the output is block 0's output plus the tail residual
    kept from the last full step (diffusers' FBCHeadBlockHook / FBCBlockHook arithmetic)."""
    calls = []

    def call(blocks, x):
        for blk in blocks:
            calls.append(blk)
            x.add_(blk)
        return x

    cache = FirstBlockCache(0.5)
    out = cache.run([torch.ones(2, 3), torch.full((2, 3), 10.0), torch.full((2, 3), 100.0)], torch.zeros(2, 3), call)
    assert torch.equal(out, torch.full((2, 3), 111.0)) and len(calls) == 3
    # block 0's residual changes by 10 %: cached, the tail (110) added to block 0's output (5 + 1.1)
    out = cache.run(iter([torch.full((2, 3), 1.1), None, None]), torch.full((2, 3), 5.0), call)
    assert torch.allclose(out, torch.full((2, 3), 116.1)) and len(calls) == 4 and cache.skipped == [False, True]
    assert cache.distances == [pytest.approx(0.1)]
    # against the last *full* step's residual (1), not the cached step's: 2 is 100 % off, so every block runs
    out = cache.run([torch.full((2, 3), 2.0), torch.ones(2, 3), torch.ones(2, 3)], torch.zeros(2, 3), call)
    assert torch.equal(out, torch.full((2, 3), 4.0)) and cache.skipped == [False, True, False]
    with pytest.raises(ValueError, match="threshold"):
        FirstBlockCache(-1.0)


# ---- diffusers' First Block Cache on its H3 transformer (the oracle) --------------------------------------------------
def test_fast_matches_diffusers_first_block_cache():
    """diffusers' `apply_first_block_cache` with the same threshold, on its H3 transformer holding the same weights
    (its block type registered with the hooks' block registry, which does not list it): the same steps skipped,
    the same latents within DIFFUSERS_RTOL."""
    pytest.importorskip("diffusers")
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    from tests.test_dit_model import diffusers_forward, diffusers_model, inputs

    cfg = DiTConfig.tiny(num_layers=3)
    dm = diffusers_model(cfg)
    ours = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16).eval()
    ours.load_state_dict(from_diffusers(dm.state_dict()))
    lay = build_layout(cfg, 7, 22, 64, 96)  # t2va: no conditioning rows
    x = inputs(cfg, lay)

    # H3's block returns its one residual stream (text, video and audio rows packed): a plain tensor, index 0.
    TransformerBlockRegistry.register(MiniMaxH3TransformerBlock, TransformerBlockMetadata(
        return_hidden_states_index=0, return_encoder_hidden_states_index=None))
    apply_first_block_cache(dm, FirstBlockCacheConfig(threshold=THRESHOLD))
    head = dm.transformer_blocks[0]._diffusers_hook.get_hook("fbc_leader_block_hook")
    theirs_skipped = []

    def theirs(xv, xa, tv, ta):
        with dm.cache_context("cond"):
            v, a = diffusers_forward(dm, lay, xv, xa, x[2], float(tv), float(ta))
            theirs_skipped.append(not head.state_manager.get_state().should_compute)
        return v, a

    with torch.no_grad():
        v_ref, a_ref = sample(theirs, x[0], x[1], SamplerConfig(steps=STEPS))
    cache = FirstBlockCache(THRESHOLD)
    v, a, _ = run(ours, lay, x, cache)
    print("ours", cache.skipped, [f"{d:.4f}" for d in cache.distances], "diffusers", theirs_skipped)
    assert cache.skipped == theirs_skipped and 0 < cache.cached_steps < STEPS - 1
    assert all(abs(d - THRESHOLD) > 1e-3 for d in cache.distances)
    ev, ea = rel(v, v_ref), rel(a, a_ref)
    print(f"fast vs diffusers' hook: video {ev:.2e}, audio {ea:.2e}")
    assert ev < DIFFUSERS_RTOL and ea < DIFFUSERS_RTOL


# ---- parallel ranks decide together --------------------------------------------------------------------------------
def _rank(rank: int, world: int) -> dict:
    cfg, sd, lay, x = tiny_case()
    out = {}
    for sp_degree in (1, 2):  # TP2, then SP2 (the distance's sums all-reduced over the SP group)
        g = make_groups(rank, world, sp_degree)
        model = H3DiT(cfg, compute_dtype=torch.float32, chunk_rows=16, tp_group=g.tp_group, sp_group=g.sp_group)
        model.load_state_dict(shard_state_dict(sd, cfg, g.tp_rank, g.tp_size, H3DiT._tp_plan))
        cache = FirstBlockCache(THRESHOLD, g.tp_group, g.sp_group)
        v, a, _ = run(model.eval(), lay, x, cache)
        out[sp_degree] = (cache.skipped, v, a)
    return out


def test_tp_and_sp_ranks_take_the_same_decisions(case):
    _, model, lay, x = case
    one = FirstBlockCache(THRESHOLD)
    v1, a1, _ = run(model, lay, x, one)
    outs = run_ranks(_rank, 2)
    for sp_degree in (1, 2):
        (s0, v0, a0), (s1, v, a) = outs[0][sp_degree], outs[1][sp_degree]
        assert s0 == s1 == one.skipped, (sp_degree, s0, s1, one.skipped)
        assert torch.equal(v0, v) and torch.equal(a0, a), f"SP{sp_degree}: ranks differ"
        assert rel(v0, v1) < 1e-4 and rel(a0, a1) < 1e-4
