"""The package's names are imported on first use: every exported name resolves, and the parts
the platform imports in each Django process (protocol, archives) do not bring the agent in."""

from __future__ import annotations

import subprocess
import sys

import serving_agent


def test_every_exported_name_resolves_to_its_module():
    for name in serving_agent.__all__:
        value = getattr(serving_agent, name)
        assert value is not None
    assert set(serving_agent.__all__) - {"__version__"} == set(serving_agent._EXPORTS)


def test_the_platform_side_modules_do_not_import_the_agent():
    code = (
        "import sys, serving_agent.protocol, serving_agent.torch_archive, "
        "serving_agent.hf_archive; print('serving_agent._agent' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
