"""The hub's gRPC face: the rlfleet.v1.Reward servicer over the scoring core, errors mapped once.

An Overloaded refusal carries trailing metadata `grpc-retry-pushback-ms` (HTTP's Retry-After, in ms), so a
client tells a full hub, worth retrying, from a request too large for it, which shares RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from grpc import aio

from rlfleet.errors import InvalidInput
from rlfleet.grpc_errors import ErrorInterceptor
from rlfleet.grpc_limits import message_size_options
from rlfleet.v1 import reward_pb2, reward_pb2_grpc
from rlfleet_reward.admission import RETRY_AFTER_SECONDS, Overloaded
from rlfleet_reward.scoring import Scorer

_SCORE_METHOD = "/rlfleet.v1.Reward/Score"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    async def Score(  # noqa: N802 - the generated servicer's method name
        self, request: reward_pb2.ScoreRequest, context: aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        try:
            return await self.scorer.score(request)
        except Overloaded:
            # RESOURCE_EXHAUSTED also means "too large, never retry"; the pushback, gRPC's own retry-after, tells
            # a client that this one is worth retrying, and when. The interceptor aborts with the error's status.
            context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(RETRY_AFTER_SECONDS * 1000)),))
            raise

    async def ListFunctions(  # noqa: N802 - the generated servicer's method name
        self, request: reward_pb2.ListFunctionsRequest, context: aio.ServicerContext
    ) -> reward_pb2.ListFunctionsResponse:
        return self.scorer.list_functions()

    async def ValidateSpec(  # noqa: N802 - the generated servicer's method name
        self, request: reward_pb2.ValidateSpecRequest, context: aio.ServicerContext
    ) -> reward_pb2.ValidateSpecResponse:
        return self.scorer.validate_spec(request)


def create_grpc_server(scorer: Scorer, address: str, max_message_bytes: int) -> tuple[aio.Server, int]:
    """A server bound to `address` (port 0 picks one); returns it, not yet started, with its port."""

    def count_malformed(method: str) -> None:
        # Refused before the scorer, which counts every other Score request: counted here, as HTTP does.
        if method == _SCORE_METHOD:
            scorer.metrics.requests.labels(InvalidInput.kind).inc()

    interceptor = ErrorInterceptor(on_malformed=count_malformed)
    server = aio.server(interceptors=[interceptor], options=message_size_options(max_message_bytes))
    reward_pb2_grpc.add_RewardServicer_to_server(RewardServicer(scorer), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {address}")
    return server, port
