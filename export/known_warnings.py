"""The warnings `attnserve export` knows to be harmless, silenced while it runs; every other one shows.

    @known_warnings_silenced()
    def main(argv): ...

Two sources print them on every successful export:

- The tracer (`torch.onnx.export` of the standard graph) warns at each Python value read from a tensor,
  because the graph keeps the value it had while tracing. The statements in `HARMLESS_TRACER_STATEMENTS`
  read sizes one exported graph fixes (head count, head size) or check a shape and raise, which the
  graph's inputs never trigger. A warning at any other statement (a data-dependent branch, say) still
  shows; so does one at these statements once their text changes, to be judged again.
- onnxruntime's dynamic quantizer asks, on the root logger, for its pre-processing (symbolic shape
  inference and graph optimisation) on any graph not marked as pre-processed. The INT8 graphs are
  quantized as written on purpose (`export.variants.quantize`; the serving graph's contrib operators
  defeat that shape inference) and are bounded against fp32 by the server's start-up self-check.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import logging
import warnings
from pathlib import Path

# (file under the repository, the statement as written) -> why its value may be a constant in the graph
HARMLESS_TRACER_STATEMENTS = {
    ("model/gpt.py", "if total > self.config.n_ctx:"): "a guard that raises; the runners never pass the context",
    ("model/gpt.py", "if attention_mask is not None and attention_mask.shape != (B, total):"):
        "a guard that raises; the graph's mask always has this shape",
    ("model/attention.py", "if k.size(1) != q.size(1):  # each KV head serves its group of query heads"):
        "query and KV head counts are the model's",
    ("model/attention.py", "scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., Tq, Tk)"):
        "the head size is the model's",
    ("model/rotary.py", "if d == x.size(-1):"): "the rotated width and the head width are the model's",
}
QUANTIZER_PREPROCESS_HINT = "Please consider to run pre-processing before quantization"


def is_harmless_tracer_warning(category: type[Warning], filename: str, line: str) -> bool:
    if category.__name__ != "TracerWarning":  # torch.jit.TracerWarning, named so torch need not be imported
        return False
    path = Path(filename).as_posix()
    return any(path.endswith("/" + file) and line.strip() == statement
               for file, statement in HARMLESS_TRACER_STATEMENTS)


class _DropQuantizerHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUANTIZER_PREPROCESS_HINT)


def _show_unless_known(show, message, category, filename, lineno, file=None, line=None) -> None:
    text = line if line is not None else linecache.getline(filename, lineno)
    if not is_harmless_tracer_warning(category, filename, text):
        show(message, category, filename, lineno, file, line)


@contextlib.contextmanager
def known_warnings_silenced():
    """Within: the warnings above are dropped, all others shown as usual. Also a decorator."""
    root, hint = logging.getLogger(), _DropQuantizerHint()
    root.addFilter(hint)  # the quantizer logs through logging.warning(), on the root logger itself
    try:
        with warnings.catch_warnings():  # puts showwarning back on the way out
            warnings.showwarning = functools.partial(_show_unless_known, warnings.showwarning)
            yield
    finally:
        root.removeFilter(hint)
