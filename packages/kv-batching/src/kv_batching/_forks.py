"""The ``n`` sequences of one prompt: the first prefills it, the others fork from it.

When the first sequence's prefill samples its first token, each waiting sequence of the same
prompt samples its own from the same logits and takes a fork of the first one's pages (whole
pages shared, the last partial page copied) and of its recurrent state. A sequence that
cannot fork then goes to the queue and prefills the prompt itself.
"""

from __future__ import annotations

import logging
from typing import cast

from kv_protocol import KVRequestForking

from ._engine_core import EngineCore
from ._outputs import StepOutputs
from ._requests import EngineRequest, RequestStatus
from ._sampling_params import TokenLogprob
from ._state_cache import copy_state_caches

__all__ = ["Forks"]

logger = logging.getLogger(__name__)


class Forks:
    """Starts the waiting sequences of a prompt from its first sequence's prefill."""

    def __init__(self, core: EngineCore, outputs: StepOutputs) -> None:
        self._core = core
        self._outputs = outputs

    def ready(self, request: EngineRequest) -> list[EngineRequest]:
        """The waiting sequences of ``request``'s prompt that can fork from it now."""
        scheduler = self._core.scheduler
        if not request.followers or not isinstance(self._core.pool, KVRequestForking):
            return []
        room = scheduler.max_running - len(scheduler.running)
        return [f for f in request.followers if f.status is RequestStatus.QUEUED][: max(room, 0)]

    def start(
        self,
        leader: EngineRequest,
        follower: EngineRequest,
        chosen: tuple[int, TokenLogprob | None],
        produced: dict[int, list[int]],
    ) -> None:
        """Give ``follower`` a fork of ``leader``'s pages and state, and its first token."""
        pool = cast(KVRequestForking, self._core.pool)
        length = leader.prefilled
        try:
            pool.fork_request(leader.rid, follower.rid, length)
        except Exception as error:  # no page for the tail copy: it prefills on its own
            logger.info("request %d prefills on its own (fork failed: %r)", follower.rid, error)
            return
        leader.followers.remove(follower)
        follower.leader = None
        follower.in_pool = True
        follower.prefilled = length
        if follower.cached_tokens is None:  # its prompt was the leader's: so was its hit
            follower.cached_tokens = leader.cached_tokens
        follower.states = copy_state_caches(leader.states) if leader.states else None
        if leader.hashes is not None:
            follower.hashes = leader.hashes.copy()
        if follower.prompt_logprobs is not None and leader.prompt_logprobs is not None:
            follower.prompt_logprobs[:] = leader.prompt_logprobs
        self._core.scheduler.start_running(follower)
        self._outputs.emit(follower, chosen[0], produced, chosen[1])

    def release(self, request: EngineRequest) -> None:
        """Sequences still waiting for ``request`` go to the queue to prefill on their own."""
        for follower in list(request.followers):
            follower.leader = None
            self._core.scheduler.enqueue(follower)
        request.followers.clear()
