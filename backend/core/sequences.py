"""The engine's requests in flight, each a list of sequences: one per num_return_sequences, samples of one prompt.
The first sequence computes the prompt; the others wait until it has (its first token) and then fork from it (the
engine shares its full prompt blocks with them and copies the block holding the last prompt token)."""
from typing import Hashable

from backend.core.request import Sequence, Status


class RequestTable(dict):
    """request id -> its sequences, by sequence index; and the samples waiting for their first sequence."""

    def __init__(self):
        super().__init__()
        self.waiting_forks: dict[Sequence, list[Sequence]] = {}

    def add(self, request_id: Hashable, members: list[Sequence]) -> None:
        self[request_id] = members
        if len(members) > 1 and members[0].beams is None:        # (beams start from the search: backend/core/beams.py)
            self.waiting_forks[members[0]] = members[1:]

    def take_forks(self, first: Sequence) -> list[Sequence]:
        """The samples that start now that `first` has its prompt in the cache (none for a single sequence)."""
        return self.waiting_forks.pop(first, [])

    def drop_forks(self, request_id: Hashable) -> None:
        members = self.get(request_id)
        if members:
            self.waiting_forks.pop(members[0], None)

    def done(self, request_id: Hashable) -> bool:
        """Every sequence of the request has finished: it leaves the table."""
        if all(member.status is Status.FINISHED for member in self.get(request_id, [])):
            self.pop(request_id, None)
            return True
        return False
