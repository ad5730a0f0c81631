"""Known-harmless third-party warnings are silenced by name and source; every other warning still shows."""
import warnings

from rlhf_mcore.quiet import silence_known_warnings


def _warn_from(module_name: str, message: str, category=UserWarning):
    code = compile(f"import warnings\nwarnings.warn({message!r}, {category.__name__})", module_name, "exec")
    exec(code, {"__name__": module_name})


def test_only_the_listed_warnings_from_their_modules_are_silenced():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_known_warnings()
        _warn_from("megatron.core.optimizer", "Transformer Engine and Apex are not installed. Falling back.")
        _warn_from("megatron.core.models.backends", "Apex is not installed. Falling back to Torch Norm")
        _warn_from("rlhf_mcore.engine.x", "Transformer Engine and Apex are not installed.")  # ours: kept
        _warn_from("megatron.core.optimizer", "something else went wrong")  # another message: kept
    assert [str(w.message) for w in seen] == ["Transformer Engine and Apex are not installed.",
                                              "something else went wrong"]
