"""The render service's dry run for a local stack: what the stack `python -m client render` is about to start would
refuse, refused before it starts (its start-up costs ~10 s).

    echo '{"prompts": ["..."], "loras": [["grain.safetensors", 0.8]], "models_dir": ""}' | python -m render_svc.preflight

Exits 0 when the stack would take the renders; else prints the reason (one line) and exits 2. A process of its own, so
the client that asks stays torch-free: the checks are the stages' own rules, from the same code — prompts over the
embedded encoder's token limit (real checkpoints' tokenizers are checked by their stage) and LoRA names the DiT
cannot find. Settings come from the same H3_<STAGE>_* env vars the stack's processes will read.
"""

from __future__ import annotations

import json
import os
import sys

from stagekit.errors import InvalidArgument, NotFound


def prompt_token_limit() -> int:
    """The encoder's --max-prompt-tokens as the stack will read it."""
    from minimax_h3.text.tokenizer import MAX_PROMPT_TOKENS

    return int(os.environ.get("H3_ENCODER_MAX_PROMPT_TOKENS") or MAX_PROMPT_TOKENS)


def needs_preflight(prompts: list[str], loras: list[tuple[str, float]]) -> bool:
    """Whether `check` has anything to say: LoRAs asked for, or a prompt long enough in bytes to be over the token
    limit (a token covers at least one UTF-8 byte). Torch-free: the client asks this before spawning the check."""
    limit = prompt_token_limit()
    return bool(loras) or any(len(p.encode("utf-8", "surrogatepass")) > limit for p in prompts)


def check(prompts: list[str], loras: list[tuple[str, float]], models_dir: str) -> None:
    """InvalidArgument naming the first thing the local stack would refuse."""
    if not models_dir:
        _check_embedded_prompt_tokens(prompts)
    if loras:
        _check_loras(loras, models_dir)


def _check_loras(loras: list[tuple[str, float]], models_dir: str) -> None:
    loras_dir = os.environ.get("H3_DIT_LORAS_DIR") or (os.path.join(models_dir, "loras") if models_dir else "")
    if not loras_dir:
        raise InvalidArgument(f"--lora {loras[0][0]}: the embedded model takes no LoRAs; pass --models-dir DIR "
                              "(LoRA files in DIR/loras)")
    from minimax_h3.dit.lora import resolve_lora_path

    for name, _ in loras:
        try:
            resolve_lora_path(name, loras_dir)
        except (InvalidArgument, NotFound) as e:  # not a bare file name, absolute path refused, not found
            raise type(e)(f"--lora {name}: {e.message}") from None


def _check_embedded_prompt_tokens(prompts: list[str]) -> None:
    limit = prompt_token_limit()
    long = [p for p in prompts if len(p.encode("utf-8", "surrogatepass")) > limit]
    if not long:
        return
    from minimax_h3.text.tiny import build_tiny_tokenizer  # the embedded encoder's tokenizer
    from minimax_h3.text.tokenizer import TextTokenizer, validate_prompt

    tok = TextTokenizer(build_tiny_tokenizer(), fingerprint="embedded", check_release_ids=False)
    for p in long:
        try:
            validate_prompt(p, limit, tok)
        except InvalidArgument as e:
            raise InvalidArgument(f"{e.message} (the embedded encoder's --max-prompt-tokens)") from None


def main() -> int:
    ask = json.loads(sys.stdin.read())
    try:
        check(ask["prompts"], [(n, float(s)) for n, s in ask.get("loras", ())], ask.get("models_dir", ""))
    except (InvalidArgument, NotFound) as e:  # the request is wrong: the CLI says so and exits 2
        print(e.message, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
