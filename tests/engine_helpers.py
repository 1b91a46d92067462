"""Models for the engine's tests: they prepare and run like a ``Clef`` without a tower, and say
what ran, in which order and in which groups.

A request is ``{"id", "state"}``; its prompt is the state's bytes, all of it ``[state]``. Some
states misbehave: ``refuse`` (an InvalidValue from prepare), ``crash`` (a ValueError from
prepare), ``boom`` (a RuntimeError from run, and from every packed run it is part of).
"""

from types import SimpleNamespace

import numpy as np

from clef_gguf.core import errors


def requests(*states: str) -> list[dict]:
    return [{"id": f"{state}-{i}", "state": state} for i, state in enumerate(states)]


class OneByOne:
    """A model that does not pack: only ``prepare`` and ``run``."""

    def __init__(self) -> None:
        self.ran: list[str] = []  # request ids, in the order they ran

    def prepare(self, request: dict, *, truncate_state: bool = False) -> SimpleNamespace:
        if request["state"] == "refuse":
            raise errors.InvalidValue("refused", field="state")
        if request["state"] == "crash":
            raise ValueError("tokenizer exploded")
        ids = np.frombuffer(request["state"].encode(), dtype=np.uint8).astype(np.int32)
        encoded = SimpleNamespace(ids=np.append(ids, 0), prefix_tokens=0, state_tokens=len(ids),
                                  n_tokens=len(ids) + 1)
        return SimpleNamespace(request=request, encoded=encoded)

    def run(self, prepared: SimpleNamespace) -> tuple[dict, dict]:
        self.ran.append(prepared.request["id"])
        if prepared.request["state"] == "boom":
            raise RuntimeError("tower exploded")
        return {"answers": prepared.request["id"]}, {"total": 1.0}


class Packing(OneByOne):
    """A model whose tower decodes ``pack`` prompts together: ``run_many`` records its groups."""

    def __init__(self, pack: int = 4) -> None:
        super().__init__()
        self.pack = pack
        self.groups: list[list[str]] = []  # request ids of each run_many call

    def pack_size(self, prepared: SimpleNamespace) -> int:
        return self.pack

    def run_many(self, prepared: list, *, pack: int | None = None) -> list:
        self.groups.append([p.request["id"] for p in prepared])
        if any(p.request["state"] == "boom" for p in prepared):
            raise RuntimeError("packed pass exploded")
        return [self.run(p) for p in prepared]
