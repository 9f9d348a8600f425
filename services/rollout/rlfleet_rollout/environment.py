"""Environments: what answers the model between the turns of a `multi_turn` rollout.

An environment is an object with one method, registered under a name in the entry-point group
`rlfleet.rollout.environments` and chosen by a run's `rollout.multi_turn.environment`:

    class Echo:
        def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
            return None if len(turns) > 1 else f"\\nyou said {turns[-1]!r}; again:"

    echo = Echo()

    # pyproject.toml of the package that holds it
    [project.entry-points."rlfleet.rollout.environments"]
    echo = "my_package.echo:echo"

After every model turn, `reply` gets the episode's prompt and the text of every model turn so far,
and returns the text that enters the conversation next (a tool's output, a user's follow-up) or
None to end the episode. The returned text is tokenized and appended to the model's own tokens; it
is trained with loss mask 0. The last model turn is what the reward functions score.

`reply` is called in a worker thread, so a slow tool does not hold up generation, and several
episodes may call it at once: an environment that keeps state guards it. An exception from it
fails that episode's sample (its error names the turn and the exception), not the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from rlfleet_rollout.datasets import Prompt

ENTRY_POINT_GROUP = "rlfleet.rollout.environments"


@runtime_checkable
class Environment(Protocol):
    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None: ...
