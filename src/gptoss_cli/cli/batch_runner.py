"""The `gptoss run` loop: keep the engine full, write each record when its last token arrives.

Requests are submitted up to a window (all of a small file at once; continuous batching is the
engine's business), then `engine.step()` is called until everything is done. A request whose
answer reaches one of its stop sequences is aborted there and finished like the others. The
window counts records handed out but not yet written, so the ordered writer's buffer stays
bounded too. A request the engine rejects (prompt longer than the context, …) becomes that line's
error record and the others carry on. On a stop request (Ctrl+C), requests that have not produced
a token yet are aborted (resume redoes them) and the rest finish; on a second one, everything is
aborted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..runtime.errors import RequestError
from .batch_input import BatchLine, LineError
from .batch_jobs import Job, JobSettings, failed_record, finished_record, prepare
from .batch_progress import BatchProgress
from .batch_signals import StopRequests
from .batch_writer import RecordWriter


@dataclass
class RunOutcome:
    handed_out: int = 0  # lines taken from the input
    aborted: int = 0  # taken but given no record (stopped before they finished)
    prompt_tokens: int = 0
    out_tokens: int = 0
    input_exhausted: bool = False


class BatchRunner:
    """Drives one engine over a stream of batch lines."""

    def __init__(self, engine, tokenizer, writer: RecordWriter, progress: BatchProgress, settings: JobSettings,
                 stop: StopRequests, window: int = 1024, ordered: bool = True) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.engine = engine
        self.tokenizer = tokenizer
        self.writer = writer
        self.progress = progress
        self.settings = settings
        self.stop = stop
        self.window = window
        self.ordered = ordered
        self.outcome = RunOutcome()
        self._inflight: dict[str, Job] = {}

    def run(self, lines: Iterator[BatchLine]) -> RunOutcome:
        try:
            self._loop(lines)
        except BaseException:
            try:
                self._abort(lambda job: True)
            except Exception:  # noqa: BLE001 - the original failure is the one to report
                pass
            raise
        return self.outcome

    def _loop(self, lines: Iterator[BatchLine]) -> None:
        while True:
            if self.stop.aborting:
                self._abort(lambda job: True)
                return
            if self.stop.stopping:
                self._abort(lambda job: not job.started)
            else:
                self._submit_more(lines)
            if not self._inflight:
                if self.outcome.input_exhausted or self.stop.stopping:
                    return
                continue
            for event in self.engine.step():
                self._on_event(event)
            self.progress.tick()

    def _room(self) -> bool:
        open_records = self.outcome.handed_out - self.writer.next_seq if self.ordered else len(self._inflight)
        return open_records < self.window

    def _submit_more(self, lines: Iterator[BatchLine]) -> None:
        while self._room() and not self.stop.stopping:
            line = next(lines, None)
            if line is None:
                self.outcome.input_exhausted = True
                return
            seq = self.outcome.handed_out
            self.outcome.handed_out += 1
            job, error = prepare(line, seq, self.settings, self.tokenizer)
            if error is None:
                error = self._add(job)
            if error is not None:
                self._finish(job, failed_record(job, error), ok=False)

    def _add(self, job: Job) -> LineError | None:
        try:
            rid = self.engine.add_request(job.prompt, job.params, request_id=f"line-{job.line.number}")
        except RequestError as e:
            return LineError(e.code, str(e))
        self._inflight[rid] = job
        self.outcome.prompt_tokens += len(job.prompt)
        return None

    def _on_event(self, event) -> None:
        job = self._inflight.get(event.request_id)
        if job is None:
            return
        job.started = True
        self.outcome.out_tokens += 1
        self.progress.tokens(1)
        output = event.output
        if event.finish_reason is None:
            if job.watch is None or not job.watch.feed(event.token_id):
                return
            # The answer reached a stop sequence: no need to generate further (between steps).
            output = self.engine.abort(event.request_id)
            if output is None:
                return
        del self._inflight[event.request_id]
        self._finish(job, finished_record(job, output, self.tokenizer, self.settings), ok=True)

    def _finish(self, job: Job, record: dict, ok: bool) -> None:
        self.writer.put(job.seq, record, ok)
        self.progress.record(ok)

    def _abort(self, which) -> None:
        for rid, job in list(self._inflight.items()):
            if which(job):
                del self._inflight[rid]
                self.engine.abort(rid)
                self.outcome.aborted += 1
                self.writer.put(job.seq, None)  # a hole: resume redoes this line
