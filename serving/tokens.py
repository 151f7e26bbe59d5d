"""Counting a request's prompt tokens, for bucketing and the max-length check.

A local tokenizer (``tokenizer.json`` beside the model) costs microseconds; the upstream's
``/tokenize`` costs a round trip, so it is the fallback when no local tokenizer is known;
``chars`` (characters / 4) is a last resort that needs nothing.

A prompt far over the model's length is refused before it is tokenized (a 1 MB prompt held the
event loop for over a second): no token of the tokenizer is longer than its longest vocabulary
entry, so ``characters / longest entry`` is a lower bound on the tokens. Long prompts under
that bound are tokenized in a worker thread.

What a body's size costs (collecting its texts, counting characters: a list of 1.6 million
prompts held the loop half a second) is ``prompt_text``, a pure function: the gateway runs it
where it parses a large body (``request_body.BodyInspector``), and ``count`` takes its result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

log = logging.getLogger(__name__)

#: Template tokens a chat message adds around its content (role markers, newlines): an estimate
#: used with a local tokenizer, which does not render the upstream's chat template.
CHAT_TOKENS_PER_MESSAGE = 4
#: Prompts with more characters than this are tokenized off the event loop.
OFF_LOOP_CHARS = 16_384


class PromptTooLong(ValueError):
    """The prompt has more tokens than the model's length (known without tokenizing it all)."""


def _texts(body: dict[str, Any], chat: bool) -> list[str] | list[int]:
    if chat:
        out: list[str] = []
        for m in body["messages"]:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                out.append(c)
            elif isinstance(c, list):  # content parts
                out.extend(p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
        return out
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return p  # token ids
    if isinstance(p, list):
        return [x if isinstance(x, str) else "" for x in p]
    return [str(p)]


@dataclass(frozen=True, slots=True)
class PromptText:
    """A body's prompt as counting needs it, computed once (``prompt_text``): the texts (or
    ``token_ids``, the length of a prompt given as token ids) and their characters."""

    texts: list[str]
    token_ids: int | None
    max_chars: int
    total_chars: int


def prompt_text(body: dict[str, Any], chat: bool) -> PromptText:
    """The prompt of a validated body; linear in its size (run it off the loop for big ones)."""
    p = None if chat else body["prompt"]
    if isinstance(p, list) and p and isinstance(p[0], list):  # a batch of token-id prompts
        return PromptText([], max(len(x) for x in p), 0, 0)  # the longest counts
    texts = _texts(body, chat)
    if texts and isinstance(texts[0], int):
        return PromptText([], len(texts), 0, 0)
    chars = [len(t) for t in texts]
    return PromptText(texts, None, max(chars, default=0), sum(chars))  # type: ignore[arg-type]


class PromptCounter:
    """``count(body, chat)`` -> prompt tokens. For a batch of prompts, the longest counts (it
    decides the bucket and the length check)."""

    def __init__(self, mode: str, tokenizer_dir: str | None) -> None:
        self.tokenizer = None
        if mode in ("auto", "local") and tokenizer_dir:
            path = Path(tokenizer_dir) / "tokenizer.json"
            if path.is_file():
                from tokenizers import Tokenizer

                self.tokenizer = Tokenizer.from_file(str(path))
            elif mode == "local":
                raise FileNotFoundError(f"serve.tokenizer=local but {path} does not exist")
        if mode == "local" and self.tokenizer is None:
            raise ValueError("serve.tokenizer=local needs serve.model (a folder with tokenizer.json)")
        self.mode = "local" if self.tokenizer is not None else ("chars" if mode == "chars" else "upstream")
        #: Characters of the longest vocabulary entry (an upper bound on one token's text).
        self.max_token_chars = (max(len(t) for t in self.tokenizer.get_vocab()) if self.tokenizer is not None
                                else (4 if self.mode == "chars" else None))

    async def count(
        self, body: dict[str, Any], chat: bool, tokenize: Callable[[dict[str, Any] | bytes], Awaitable[int]],
        limit: int | None = None, *, text: PromptText | None = None, off_loop: bool = False,
    ) -> int:
        """Prompt tokens; raises ``PromptTooLong`` when they surely exceed ``limit``. ``text``:
        ``prompt_text(body, chat)`` when the caller has it (computed off the loop); ``off_loop``:
        the body is large, so the upstream's ``/tokenize`` request is encoded in a worker thread."""
        if text is None:
            text = prompt_text(body, chat)
        if text.token_ids is not None:
            return text.token_ids
        texts = text.texts
        if limit is not None and self.max_token_chars:
            at_least = (text.total_chars if chat else text.max_chars) / self.max_token_chars
            if at_least > limit:
                raise PromptTooLong(f"the prompt has at least {math.ceil(at_least)} tokens "
                                    f"({text.total_chars} characters), more than the model's max_model_len={limit}")
        if self.mode == "upstream":
            req = {"model": body.get("model")}
            req["messages" if chat else "prompt"] = body["messages" if chat else "prompt"]
            if off_loop or text.total_chars > OFF_LOOP_CHARS:
                return await tokenize(await asyncio.to_thread(_encode, req))
            return await tokenize(req)
        if self.mode == "local":
            try:
                if not texts:
                    enc = []
                elif text.total_chars > OFF_LOOP_CHARS:
                    enc = await asyncio.to_thread(self.tokenizer.encode_batch, texts, add_special_tokens=False)
                else:
                    enc = self.tokenizer.encode_batch(texts, add_special_tokens=False)
            except TypeError as exc:
                # Text the tokenizer cannot take: a lone surrogate ("\ud800", valid JSON but not
                # UTF-8) was a 500 here; vLLM, whose tokenizer raises the same, answers 400.
                raise ValueError(f"{exc}") from None
            lens = [len(e.ids) for e in enc]
        else:
            lens = [len(t) // 4 + 1 for t in texts]
        if chat:
            return sum(lens) + CHAT_TOKENS_PER_MESSAGE * len(texts) + 1
        return max(lens, default=0) + 1  # + BOS


def _encode(req: dict[str, Any]) -> bytes:
    return json.dumps(req).encode()
