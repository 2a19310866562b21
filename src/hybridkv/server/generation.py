"""From a request body to engine requests and back: prompts to token ids (in a worker thread),
choices (prompts x ``n``) submitted together, and their outputs merged into one stream.

Choices share the prefix cache: a choice whose prompt shares at least one KV block with an
earlier choice's prompt is submitted once that choice has computed its prompt (its first output
token), so it finds those blocks cached instead of computing them a second time alongside. The
others start at once and are batched together by the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from hybridkv.engine.engine import RequestOutput
from hybridkv.engine.sampling import SEED_RANGE, SamplingParams
from hybridkv.errors import InvalidInputError
from hybridkv.server.async_engine import AsyncEngine


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine sees it."""

    token_ids: list[int]
    num_added: int
    """Tokens the server put in front (``<bos>``): part of the computation, not of what is echoed."""
    text: str | None
    """The client's text (None for a token-id prompt)."""
    checkpoint_hints: tuple[int, ...] = ()
    """Positions later requests are expected to part at (a chat's system prompt's end)."""


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_index: int
    prompt: Prompt
    params: SamplingParams


class PromptTooLong(InvalidInputError):
    """A prompt longer than the server takes."""


class Tokenize:
    """Prompt text or ids to ``Prompt``: validated, tokenized, ``<bos>`` policy applied (blocking calls)."""

    def __init__(self, encode: Callable[[str, bool], list[int]], *, bos_token_id: int, vocab_size: int,
                 max_model_len: int, max_token_chars: int, bos_for_token_prompts: bool) -> None:
        self.encode = encode
        self.bos_token_id = bos_token_id
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * max_token_chars
        """No text longer than this can fit: no token covers more than ``max_token_chars`` characters."""
        self.bos_for_token_prompts = bos_for_token_prompts

    def text(self, text: str, add_bos: bool, what: str = "the prompt") -> Prompt:
        """``text`` tokenized (blocking: run it in a worker thread); its length is checked first."""
        if not text:
            raise InvalidInputError(f"{what} is empty")
        if len(text) > self.max_chars:
            raise PromptTooLong(f"{what} has {len(text)} characters: more than max_model_len "
                                f"({self.max_model_len}) tokens can hold")
        ids = self.encode(text, add_bos)
        prompt = Prompt(ids, 1 if add_bos and ids[:1] == [self.bos_token_id] else 0, text)
        self.check_length(prompt, what)
        return prompt

    def token_ids(self, ids: list[int], add_bos: bool, what: str = "the prompt") -> Prompt:
        if not ids:
            raise InvalidInputError(f"{what} is empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidInputError(f"{what}: token ids must be integers in [0, {self.vocab_size})")
        added = int(add_bos and self.bos_for_token_prompts and ids[0] != self.bos_token_id)
        prompt = Prompt([self.bos_token_id] * added + ids, added, None)
        self.check_length(prompt, what)
        return prompt

    def check_length(self, prompt: Prompt, what: str) -> None:
        if len(prompt.token_ids) >= self.max_model_len:
            raise PromptTooLong(f"{what} has {len(prompt.token_ids)} tokens; max_model_len is {self.max_model_len} "
                                f"(prompt plus at least one generated token)")


def system_prompt_end(messages: list[dict[str, Any]], text: str, prompt: Prompt,
                      encode: Callable[[str, bool], list[int]]) -> tuple[int, ...]:
    """The token position where the conversation's leading system messages end in its rendered
    ``text`` (tokenized as ``prompt``), as a checkpoint hint; none without a system message or
    when the template does not show their content verbatim."""
    end = 0
    for m in messages:
        if m["role"] != "system":
            break
        found = text.find(m["content"], end)
        if found < 0 or not m["content"]:
            return ()
        end = found + len(m["content"])
    if not end:
        return ()
    n = _common_prefix(encode(text[:end], False), prompt.token_ids)  # a merge at the cut is left out
    return (n,) if 0 < n < len(prompt.token_ids) else ()


def make_choices(prompts: list[Prompt], params: SamplingParams, n: int) -> list[Choice]:
    """``n`` choices per prompt (index = prompt index x n + k); a seeded request gives choice k seed + k."""
    choices = []
    for p, prompt in enumerate(prompts):
        for k in range(n):
            seeded = params
            if params.seed is not None and k:
                seed = params.seed + k
                seeded = replace(params, seed=seed if seed <= SEED_RANGE[1] else seed - 2**64)
            choices.append(Choice(p * n + k, p, prompt, seeded))
    return choices


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def submission_order(choices: list[Choice], block_size: int) -> list[int | None]:
    """For each choice, the choice whose first output it waits for (None: submitted at once)."""
    leaders: list[Choice] = []
    after: list[int | None] = []
    for c in choices:
        leader = None
        if c.params.prompt_logprobs is None:  # scoring requests never use the cache
            leader = next((x.index for x in leaders if x.params.prompt_logprobs is None
                           and _common_prefix(x.prompt.token_ids, c.prompt.token_ids) >= block_size), None)
        if leader is None:
            leaders.append(c)
        after.append(leader)
    return after


async def run_choices(engine: AsyncEngine, request_id: str, choices: list[Choice], *, cache_salt: str | None,
                      priority: int, n: int) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
    """Submit ``choices`` and yield ``(choice, output)`` as outputs arrive, until every choice finished.

    An error submitting any choice (``InvalidInputError``, ``EngineClosedError``) is raised and the
    others are aborted; leaving the iteration early aborts every choice still running.
    """
    by_index = {c.index: c for c in choices}
    after = submission_order(choices, engine.config.block_size)
    started = {c.index: asyncio.Event() for c in choices}
    queue: asyncio.Queue[tuple[Choice, RequestOutput] | BaseException] = asyncio.Queue()

    async def run(choice: Choice, wait_for: int | None) -> None:
        try:
            if wait_for is not None:
                await started[wait_for].wait()
            outputs = engine.generate(f"{request_id}-{choice.index}", choice.prompt.token_ids, choice.params,
                                      cache_salt, priority=priority, n=n if choice.index == choices[0].index else None,
                                      checkpoint_hints=choice.prompt.checkpoint_hints)
            async for output in outputs:
                started[choice.index].set()
                queue.put_nowait((choice, output))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            queue.put_nowait(exc)
        finally:
            started[choice.index].set()

    tasks = [asyncio.ensure_future(run(c, w)) for c, w in zip(choices, after)]
    try:
        pending = len(choices)
        while pending:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item[1].finished:
                pending -= 1
            yield by_index[item[0].index], item[1]
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def collect_finals(first: tuple[Choice, RequestOutput],
                         outputs: AsyncIterator[tuple[Choice, RequestOutput]]) -> list[tuple[Choice, RequestOutput]]:
    """Every choice's last output (``first`` already taken from ``outputs``), in choice order."""
    finals = {first[0].index: first}
    async for choice, output in outputs:
        finals[choice.index] = (choice, output)
    return [finals[i] for i in sorted(finals)]
