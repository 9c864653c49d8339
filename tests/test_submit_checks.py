"""What only the stages can tell is refused at the render service's Submit, before a job is stored, from what the
stages themselves report: the DiT's Status (the files in its loras directory, whether it takes LoRA paths) and the
encoder's CheckPrompt (its tokenizer, its --max-prompt-tokens).

Real processes: a render service over the session's encoder and decoder and a DiT of its own, started with a loras
directory and without --allow-lora-paths. An unknown LoRA name (NOT_FOUND, as the DiT itself answers), an absolute
LoRA path and an over-long prompt (INVALID_ARGUMENT) are each refused at once, with the fix in the message, and leave
no job (their idempotency key stays unused), as does
a LoRA strength that is not finite; a LoRA file copied into the directory afterwards, as the message says, is taken at
once and renders.
"""

from __future__ import annotations

import shutil
import time

import grpc
import pytest
import torch
from safetensors.torch import save_file

from client.embedded import EmbeddedStack, StackConfig
from h3.v1 import common_pb2, encoder_pb2, render_pb2
from minimax_h3.contract import check_loras
from minimax_h3.services import Endpoints, StageClients
from render_svc.admission import DIT_STATUS_RECHECK_S
from stagekit.errors import InvalidArgument, NotFound
from tests.conftest import SERVER_ENV
from tests.render_svc_util import TERMINAL, serving, tiny_request

LONG_PROMPT = "x" * 1100  # 1,100 tokens of the embedded encoder's tokenizer; its limit is 1,024


def write_lora(path) -> None:
    """A rank-2 LoRA on the embedded DiT's first MLP output linear (kohya key names)."""
    from dit_svc.engine import embedded_config

    cfg, g = embedded_config(), torch.Generator().manual_seed(3)
    save_file({"lora_unet_blocks_0_mlp_fc2.lora_down.weight": torch.randn(2, cfg.ffn, generator=g) * 0.5,
               "lora_unet_blocks_0_mlp_fc2.lora_up.weight": torch.randn(cfg.hidden, 2, generator=g) * 0.5}, str(path))


@pytest.fixture(scope="module")
def lora_stack(stack, model_cache, tmp_path_factory):
    """(render service, its stage endpoints, the DiT's loras directory); the directory holds grain.safetensors."""
    _, endpoints = stack
    d = tmp_path_factory.mktemp("submit-checks")
    loras = d / "loras"
    loras.mkdir()
    write_lora(loras / "grain.safetensors")
    dit = EmbeddedStack(StackConfig(cache_dir=str(model_cache), run_dir=str(d / "dit"), devices="virt0",
                                    env=SERVER_ENV, extra_args={"dit": ["--loras-dir", str(loras)]}))
    dit.start_stage("dit")
    try:
        dit.wait_ready("dit")
        stages = Endpoints(endpoints.encoder, f"127.0.0.1:{dit.ports['dit']}", endpoints.decoder)
        with serving(d / "render", stages) as svc:
            yield svc, stages, loras
    finally:
        dit.stop()


def test_the_stages_report_what_submit_checks(lora_stack):
    """The DiT's Status lists its LoRA files and says it takes no paths; the encoder's CheckPrompt counts a prompt's
    tokens against its limit, and refuses an over-long one as its Encode would."""
    _, stages, loras = lora_stack
    with StageClients(stages) as c:
        st = c.dit.Status(common_pb2.StatusRequest(), timeout=30)
        assert st.loras.directory == str(loras) and "grain.safetensors" in st.loras.names
        assert not st.loras.paths_allowed
        assert not c.encoder.Status(common_pb2.StatusRequest(), timeout=30).HasField("loras")
        ok = c.encoder.CheckPrompt(encoder_pb2.PromptCheckRequest(prompt="a fox"), timeout=30)
        assert 0 < ok.tokens <= 5 and ok.max_tokens == 1024
        with pytest.raises(grpc.RpcError) as e:
            c.encoder.CheckPrompt(encoder_pb2.PromptCheckRequest(prompt=LONG_PROMPT), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt has 1100 tokens, more than the limit of 1024" in e.value.details()


def test_what_only_the_stages_know_is_refused_at_submit_and_stores_nothing(lora_stack):
    svc, _, loras = lora_stack
    outside = loras.parent / "outside.safetensors"
    shutil.copy(loras / "grain.safetensors", outside)  # a real file, but not one the DiT takes by path
    before = len(svc.stub.List(render_pb2.ListRequest(limit=1000), timeout=30).jobs)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for req, code, needles in (
            (tiny_request(loras=[("film_grain", 0.8)]), grpc.StatusCode.NOT_FOUND,
             ["LoRA 'film_grain' not found in the DiT's loras directory", str(loras), "it has grain.safetensors",
              "copy the file there"]),
            (tiny_request(loras=[("grain", 1.0), (str(outside), 0.5)]), invalid,
             [f"LoRA '{outside}': the DiT takes no LoRA paths", "grain.safetensors", "--allow-lora-paths"]),
            (tiny_request(LONG_PROMPT), invalid, ["prompt has 1100 tokens, more than the limit of 1024; shorten it"]),
            (tiny_request(loras=[("grain", float("nan"))]), invalid, ["LoRA 'grain': strength must be finite, got nan"])):
        req.idempotency_key = "refused"
        for call in (svc.stub.Submit, lambda r, timeout: list(svc.stub.Render(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=30)
            assert e.value.code() == code, e.value.details()
            assert all(n in e.value.details() for n in needles), (needles, e.value.details())
    assert len(svc.stub.List(render_pb2.ListRequest(limit=1000), timeout=30).jobs) == before


def test_a_lora_copied_in_as_the_refusal_says_renders(lora_stack):
    """The refusal names the directory; the file copied there is taken by the next Submit (the render service asks
    the DiT again rather than trusting the Status it read before), and the job renders with it."""
    svc, _, loras = lora_stack
    req = tiny_request(loras=[("rain", 0.8)], idempotency_key="refused")
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Submit(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and str(loras) in e.value.details()
    shutil.copy(loras / "grain.safetensors", loras / "rain.safetensors")
    time.sleep(DIT_STATUS_RECHECK_S + 0.5)  # the DiT's Status the service holds is old enough to be read again
    job = svc.stub.Submit(req, timeout=30)
    info = svc.wait_state(job.job_id, TERMINAL, timeout_s=300)
    assert info.state == render_pb2.JOB_SUCCEEDED, (info.error_code, info.error, svc.log())


def test_check_loras_rules():
    """The refusal rules by themselves (minimax_h3.contract.check_loras), as the render service applies them to a
    DiT's Status: names with or without ".safetensors", no directory, an empty one, paths when allowed."""
    served = ["a.safetensors", "b.safetensors", "notes"]
    for names in (["a"], ["a.safetensors"], ["notes"], ["b", "a"], []):
        check_loras(names, "/m/loras", served, paths_allowed=False)
    check_loras(["/elsewhere/c.safetensors"], "/m/loras", served, paths_allowed=True)
    for names, directory, have, error, needle in (
            (["c"], "/m/loras", served, NotFound, "LoRA 'c' not found in the DiT's loras directory /m/loras: it has "
                                                  "a.safetensors, b.safetensors, notes; name one of those"),
            (["a", "notes.safetensors"], "/m/loras", served, NotFound, "LoRA 'notes.safetensors' not found"),
            (["a"], "/m/loras", [], NotFound, "it holds no files; copy the LoRA file there"),
            (["a"], "", [], NotFound, "the DiT has no loras directory, so it takes no LoRAs by name; LoRA files go in "
                                      "<models-dir>/loras"),
            (["../a.safetensors"], "/m/loras", served, NotFound, "LoRA '../a.safetensors' not found"),
            (["/m/loras/a.safetensors"], "/m/loras", served, InvalidArgument, "the DiT takes no LoRA paths"),
            (["z"], "/m/loras", [f"{i:02d}.safetensors" for i in range(25)], NotFound,
             "18.safetensors, 19.safetensors and 5 more")):
        with pytest.raises(error) as e:
            check_loras(names, directory, have, paths_allowed=False)
        assert needle in e.value.message, e.value.message
