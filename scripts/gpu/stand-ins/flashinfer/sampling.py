"""The two names SGLang 0.5.16's sampler imports; calling either is a configuration error on this host."""

from typing import Any, NoReturn


def _unavailable(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise RuntimeError("flashinfer is not installed on this host (import stand-in): run SGLang with "
                       "--sampling-backend pytorch")


top_k_top_p_sampling_from_probs = _unavailable
min_p_sampling_from_probs = _unavailable
