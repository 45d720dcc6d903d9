"""Errors raised by the tracer.

Every error names what it is about -- the file, the rank, the step and the tensor
where they are known -- and says what to do next. Bad input never raises a bare
``KeyError``/``JSONDecodeError``/``SafetensorError``: those are caught and wrapped
here so that a user reading a trace of a 512-rank run knows which file to look at.

NaN/Inf values in a traced tensor are *not* errors: they are findings
(:meth:`tracer.trace.store.TraceReader.findings`).
"""
from __future__ import annotations

from pathlib import Path


#: exit codes of the ``ttrace`` commands (:func:`ttrace_num.cli.run_cli`)
EXIT_CONSISTENT = 0  # success; compare: consistent
EXIT_DIVERGENT = 1   # compare: DIVERGENT
EXIT_BAD_INPUT = 2   # bad input: an invalid option, a trace error (every TraceError)
EXIT_INTERNAL = 3    # an internal error (a bug of ttrace)


class TraceError(Exception):
    """Base class of tracer errors; carries the context it is about.

    Attributes ``path``, ``rank``, ``step`` and ``tensor`` are ``None`` where they
    do not apply; the message always repeats the ones that do. ``exit_code`` is what a
    ``ttrace`` command exits with on it: 2, bad input (0 consistent, 1 divergent, 2 bad
    input, 3 internal error).
    """

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, path: str | Path | None = None, rank: int | None = None,
                 step: int | None = None, tensor: str | None = None) -> None:
        self.path = None if path is None else str(path)
        self.rank = rank
        self.step = step
        self.tensor = tensor
        where = [f"{k} {v}" for k, v in (("file", self.path), ("rank", rank), ("step", step),
                                           ("tensor", tensor)) if v is not None]
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)


class TraceWriteError(TraceError):
    """A trace file could not be written (disk full, permissions, ...).

    No partial file is left under the final name and the buffered tensors of the
    step are kept, so the write can be retried after the cause is fixed.
    """


class MissingRankError(TraceError):
    """A rank's manifest (or its tensor file) for a step is absent."""


class CorruptTraceError(TraceError):
    """A manifest is not valid JSON or lacks fields, or a safetensors file is truncated or corrupt."""


class ManifestMismatchError(TraceError):
    """A manifest disagrees with its file, its path, or the run (another model, layout or run)."""


class IncomparableRunsError(TraceError):
    """Two traces cannot be compared: model signature, steps or tensor names differ.

    ``differences`` lists one line per differing field.
    """

    def __init__(self, differences: list[str]) -> None:
        self.differences = list(differences)
        super().__init__("traces are not comparable:\n  - " + "\n  - ".join(self.differences))


class TraceDirectoryInUseError(TraceWriteError):
    """A writer refused its directory: a trace of another run is there (``run.json`` names another
    run id while step directories exist), or another writer of the same rank holds its lock file."""


class RefusedComparisonError(TraceError):
    """:func:`tracer.compare.check.compare` refuses to give a verdict: what it would compare is
    not what the user asked for, or the verdict would be meaningless (fail closed)."""


class UnmatchedRecordsError(RefusedComparisonError):
    """Records of a checked phase exist in one trace only (e.g. the candidate's module names carry a
    wrapper's prefix no known one explains); ``compare(skip=...)`` names what to leave out."""


class MissingStepError(RefusedComparisonError):
    """A requested step is missing in the reference or the candidate."""


class EmptyTraceError(RefusedComparisonError):
    """The candidate (or the reference) holds no tensor to compare."""


class NoNoiseError(RefusedComparisonError):
    """The reference has no noise samples: thresholds would be meaningless."""


class SwappedTracesError(RefusedComparisonError):
    """The reference is a multi-rank trace without noise samples of its own run and world size:
    reference and candidate are probably swapped (a distributed reference carries its own noise
    samples, docs/distributed-reference.md)."""


class ReferenceReplicasError(RefusedComparisonError):
    """A distributed reference disagrees with itself: copies of a tensor its placements mark as
    replicated differ bitwise across its ranks (docs/distributed-reference.md)."""


class SameRunError(RefusedComparisonError):
    """Two traces that must be of different runs are of the same one (the candidate, or a noise
    sample, is the reference itself or a copy of it)."""


class NoiseSampleError(RefusedComparisonError):
    """A noise sample is unusable: NaN/Inf where the clean reference has none."""
