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


def test_datasets_progress_bars_stay_off_without_importing_datasets(tmp_path):
    """silence_known_warnings() before `datasets` is imported (the launch scripts' order) does not import it (it
    costs ~1 s in commands that read no dataset, e.g. --print-config), yet loading a parquet file afterwards draws no
    "Generating train split" bar. Mutation: drop the HF_DATASETS_DISABLE_PROGRESS_BARS default -> fails."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.subprocess_env import child_env

    pq.write_table(pa.table({"a": [1, 2, 3]}), tmp_path / "x.parquet")
    code = ("import sys\nfrom rlhf_mcore.quiet import silence_known_warnings\nsilence_known_warnings()\n"
            "assert 'datasets' not in sys.modules\nimport datasets\n"
            f"datasets.load_dataset('parquet', data_files={str(tmp_path / 'x.parquet')!r}, "
            f"cache_dir={str(tmp_path / 'cache')!r})\n")
    env = {k: v for k, v in child_env().items() if k != "HF_DATASETS_DISABLE_PROGRESS_BARS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Generating" not in out.stderr, out.stderr[-2000:]
