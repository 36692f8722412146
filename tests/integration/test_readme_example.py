"""The embedded-use example in README.md runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_examples_run_as_written_and_round_trip_bytes(tmp_path: Path) -> None:
    examples = re.findall(
        r"<!-- readme-example:start -->\s*```python\n(.*?)```\s*<!-- readme-example:end -->",
        README.read_text(),
        re.S,
    )
    assert len(examples) == 2, "README.md lost a marked example"
    outputs = []
    for i, code in enumerate(examples):
        script = tmp_path / f"example_{i}.py"
        script.write_text(code)
        result = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"example {i} failed:\n{result.stderr}"
        outputs.append(result.stdout)
    assert "loaded them back byte-exact" in outputs[0]
