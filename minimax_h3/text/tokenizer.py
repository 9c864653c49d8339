"""Prompt tokenization for the H3 text conditioner (Qwen3-VL tokenizer, `tokenizers` package).

H3 uses no chat template and no special tokens (``add_special_tokens=False``, no BOS/EOS, no padding;
docs/model.md §6). The release tokenizer adds dialogue/lyrics/caption markers that users
type into prompts (``<d>…</d>`` wraps dialogue), so *added* tokens in the prompt text are honoured;
vision markers, however, are only valid when the server builds a vision block itself, so a plain
text prompt containing them is rejected by :func:`validate_prompt`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import Tokenizer

from stagekit.errors import FailedPrecondition, InvalidArgument

# Qwen2/3-VL special ids (the first three and the vision block markers are shared by the family;
# 151669+ are the H3 release additions, §6). Checked against tokenizer.json at load when present.
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<d>": 151669,
    "</d>": 151670,
    "<|cutoff|>": 151671,
    "<|lyrics_start|>": 151672,
    "<|lyrics_end|>": 151673,
    "<|caption_start|>": 151674,
    "<|caption_end|>": 151675,
}
MAX_PROMPT_TOKENS = 1024  # the encoder stage's default --max-prompt-tokens (the client checks against it too)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# Chat-template markers: H3 uses none, so a prompt carrying them was built for another model.
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class PromptError(InvalidArgument):
    """Bad prompt (maps to gRPC INVALID_ARGUMENT). ``token_count`` is None when the text could not be decoded."""

    def __init__(self, message: str, *, token_count: int | None, limit: int, reason: str):
        super().__init__(message)
        self.token_count = token_count
        self.limit = limit
        self.reason = reason  # "not_utf8" | "empty" | "too_long" | "reserved_token"


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the special-token ids H3 cares about."""

    def __init__(self, tok: Tokenizer, *, fingerprint: str, check_release_ids: bool = True):
        self._tok = tok
        self.fingerprint = fingerprint
        self.special_ids: dict[str, int] = {}
        wrong = []
        for name, want in SPECIAL_TOKENS.items():
            got = tok.token_to_id(name)
            if got is None:
                continue
            self.special_ids[name] = got
            if check_release_ids and got != want:
                wrong.append(f"{name}: file id {got}, release id {want}")
        if wrong:
            raise FailedPrecondition(
                "tokenizer.json disagrees with the Qwen3-VL / H3 special-token ids (" + "; ".join(wrong) + "); "
                "use the tokenizer shipped with the model, or check_release_ids=False for a test tokenizer"
            )

    @classmethod
    def from_file(cls, path: str | Path, *, check_release_ids: bool | None = None) -> "TextTokenizer":
        """``tokenizer.json`` or a directory containing it. Release-id check defaults on for big vocabularies."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.exists():
            raise FileNotFoundError(f"tokenizer not found: {p}")
        data = p.read_bytes()
        tok = Tokenizer.from_str(data.decode("utf-8"))
        if check_release_ids is None:
            check_release_ids = tok.get_vocab_size(with_added_tokens=True) > 150000
        return cls(tok, fingerprint=hashlib.sha256(data).hexdigest(), check_release_ids=check_release_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Raw prompt -> ids: no template, no BOS/EOS, no padding, no truncation."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_id(self, name: str) -> int:
        if name not in self.special_ids:
            raise KeyError(f"special token {name!r} is not in this tokenizer")
        return self.special_ids[name]


def validate_prompt(text: str | bytes, max_tokens: int, tokenizer: TextTokenizer) -> tuple[str, list[int]]:
    """Decode (bytes must be UTF-8), tokenize and bound a t2va prompt -> (text, ids).

    Raises :class:`PromptError` (a ValueError) for non-UTF-8, empty / whitespace-only, over-long
    prompts, and prompts that embed vision or chat-template markers; the message names the token count
    and the limit.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if isinstance(text, (bytes, bytearray, memoryview)):
        raw = bytes(text)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PromptError(
                f"prompt is not valid UTF-8 (bad byte at offset {e.start}); limit is {max_tokens} tokens",
                token_count=None, limit=max_tokens, reason="not_utf8",
            ) from None
    elif isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates
            raise PromptError(
                f"prompt is not valid Unicode text (unpaired surrogate at index {e.start}); limit is {max_tokens} tokens",
                token_count=None, limit=max_tokens, reason="not_utf8",
            ) from None
    else:
        raise TypeError(f"prompt must be str or bytes, got {type(text).__name__}")
    if not text.strip():
        raise PromptError(
            f"prompt is empty (0 tokens); it needs 1 to {max_tokens} tokens",
            token_count=0, limit=max_tokens, reason="empty",
        )
    ids = tokenizer.encode(text)
    n = len(ids)
    if n > max_tokens:
        raise PromptError(
            f"prompt has {n} tokens, more than the limit of {max_tokens}; shorten it",
            token_count=n, limit=max_tokens, reason="too_long",
        )
    reserved = {tokenizer.special_ids[t]: t for t in (*VISION_TOKENS, *CHAT_TOKENS) if t in tokenizer.special_ids}
    found = sorted({reserved[i] for i in ids if i in reserved})
    if found:
        raise PromptError(
            f"prompt contains reserved marker(s) {', '.join(found)} ({n} tokens, limit {max_tokens}): "
            "H3 prompts use no chat template, and vision blocks are built by the server from images",
            token_count=n, limit=max_tokens, reason="reserved_token",
        )
    return text, ids
