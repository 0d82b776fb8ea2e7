"""Async decode: launch decode step t+1 before reading step t's tokens back.

A decode step is GPU work plus host work (schedule, plan, upload, append tokens). Run one after
the other, the host work leaves the GPU idle; at long context on an H200 it is ~10% of a token.
With ``EngineConfig.async_decode`` (default on; ``--no-async-decode``) :meth:`LLMEngine.step`
chains consecutive pure-decode steps:

1. step t has been launched (its greedy tokens are on the device, on their way to pinned host
   memory behind a CUDA event: :class:`HostTokens`);
2. step t+1 is planned and launched at once: each sequence gets a placeholder token
   (:meth:`Sequence.reserve_token`) so its next position has a page, and the input ids of
   step t+1 are gathered from step t's tokens on the device (CUDA graphs: into
   ``DecodeGraphs.inputs`` after the pinned upload, in stream order before the replay);
3. only then does the host wait for step t's tokens, fill the placeholders (EOS, stop strings
   and detokenization as usual) and return step t's outputs, while the GPU runs step t+1.

So ``step()`` still returns the outputs of exactly one step, the same ones, in the same order,
as the synchronous engine. Choices:

* Chaining needs: every sequence of step t decodes and samples greedily (sampling needs logits
  on the host), nothing waits, nothing else runs (no prefill), and step t+1's pages can be
  taken without preemption (preemption recomputes from real token values, so it never happens
  with a placeholder pending). Otherwise the pending step is drained: its tokens are read and
  returned, and the next ``step()`` schedules as the synchronous engine does.
* A sequence whose step-t token ends it by length (``max_tokens``, ``max_model_len``) gets no
  row in step t+1. One that ends by EOS or a stop string is only known after step t+1 was
  launched: its row there is wasted and discarded, and the sequence is freed as soon as step
  t's token is read. GPU work is stream-ordered, so a later step that reuses its pages or
  selection slot runs after the wasted row wrote them.
* ``abort()`` between steps frees the sequence at once; the pending step's row for it is
  discarded. A pending step whose rows are all finished or aborted is dropped unread.
* The host buffers the GPU may still read or write when the host moves on are double-buffered
  (pinned token read-back here, pinned input staging in ``DecodeGraphs``): the buffer of step
  t-1 is reused by step t+1 only after step t-1's tokens have been read.
* On the CPU (torch backend) the same code runs on a synchronous device: the "device" tokens
  are a CPU tensor, and tests exercise the chaining, placeholders and discards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LaunchedStep:
    """A step whose forward has been launched; its tokens are read by ``LLMEngine._finish``.

    ``samplers[i]`` gets row ``i`` of ``greedy`` (device long [len(samplers)]); ``fetch`` is
    the pending host copy of ``greedy`` (:meth:`HostTokens.start`).
    """

    batch: list  # list[Scheduled]
    samplers: list  # list[Sequence]
    logits: torch.Tensor | None
    greedy: torch.Tensor | None
    fetch: tuple | None
    num_tokens: int
    chained: bool = False  # launched before the previous step's tokens were read
    graph: bool = False  # replayed a captured CUDA graph
    extras: object = None  # StepExtras: logprobs or processed logits (penalties, bias, min_tokens)
    prefill_marks: tuple | None = None  # CUDA events around the prefill forward of a graph + prefill step

    @property
    def pure_greedy_decode(self) -> bool:
        """Every row decodes one token and samples greedily from the plain logits (no logprobs,
        penalties, bias or ``min_tokens``, which need each token before the next step): the
        next step can be chained."""
        return self.extras is None and bool(self.samplers) and len(self.samplers) == len(self.batch) and all(
            item.decode and item.seq.params.greedy for item in self.batch)

    def live(self) -> list[tuple[int, object]]:
        """(row, sequence) of the rows whose sequence is neither finished nor aborted."""
        return [(row, s) for row, s in enumerate(self.samplers) if s.finish_reason is None]


class HostTokens:
    """Greedy tokens from the device to the host without waiting on later work.

    On CUDA, :meth:`start` queues a copy into one of two pinned buffers and records an event;
    :meth:`read` waits for that event only, so a step launched after it keeps the GPU busy
    (``Tensor.tolist`` would wait for the whole stream). On the CPU the tensor is read as is.

    Parameters
    ----------
    device : str or torch.device
    max_rows : int
        Most tokens one step samples (the engine's ``max_num_seqs``).
    """

    def __init__(self, device, max_rows: int) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._pins = [torch.zeros(max_rows, dtype=torch.long).pin_memory() for _ in range(2)] if self.cuda else []
        self._next = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Begin moving ``tokens`` (long [n]) to the host; returns the handle :meth:`read` takes."""
        if not self.cuda:
            return tokens, None
        pin = self._pins[self._next][: tokens.numel()]
        self._next ^= 1  # the other buffer belongs to the step before, which may be unread
        pin.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return pin, event

    @staticmethod
    def read(fetch: tuple[torch.Tensor, object]) -> list[int]:
        """The tokens of a :meth:`start` handle (waits for the step that produced them)."""
        tokens, event = fetch
        if event is not None:
            event.synchronize()
        return tokens.tolist()
