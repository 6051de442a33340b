"""Reading the study in JupyterLab as a reader does: `make lab`'s server (scripts/lab.py) on a free localhost port,
driven in headless Debian chromium through selenium; and a parameterized source notebook run top to bottom on the
project's kernel, started through the server's REST API and driven over its WebSocket.

The expected counts are read from the notebook files themselves: every PNG output must be an <img> in the rendered
DOM, and every table (a DataFrame's HTML, a Markdown table in an output or a Markdown cell) a <table>. The report
notebook's screenshot goes to data/lab/ (not committed); the counts the test saw go to data/lab/rendered.json.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
OUT = ROOT / "data" / "lab"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
EXECUTED = ["figures/notebooks/02_baseline_training.ipynb", "figures/notebooks/00_report.ipynb"]
# The quickest source notebook: it reads the committed results (nothing trained or accounted) and writes their metrics.
SOURCE = "notebooks/09_combinations.ipynb"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="Debian's chromium and chromium-driver are not installed "
                       "(`make setup` installs them when run as root; else apt-get install chromium chromium-driver)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, token: str, path: str, body: dict | None = None, method: str | None = None) -> dict:
    req = urllib.request.Request(f"{base}{path}", method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read()
    return json.loads(text) if text else {}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("lab")
    # Every cell in the DOM (no virtual scrolling of cells out of view), so that the counts are the notebook's.
    tracker = tmp / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), uuid.uuid4().hex
    # A fresh workspace too: JupyterLab restores the panels a previous session left open (an earlier run of this
    # test leaves the report open), and their figures would count with the notebook under test.
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces")}
    log = (tmp / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "scripts/lab.py", "--port", str(port), "--token", token], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            _api(base, token, "/api/status")
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, (tmp / "server.log").read_text()[-3000:]
            time.sleep(0.5)
    yield base, token
    os.kill(proc.pid, signal.SIGTERM)  # the server is the process itself: scripts/lab.py execs it
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    log.close()


def _tables_in_markdown(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.fullmatch(r"\s*\|?(\s*:?-{3,}:?\s*\|)+\s*(:?-{3,}:?\s*)?\|?\s*", line))


def expected(path: str) -> tuple[int, int]:
    """(PNG outputs, tables) of an executed notebook, as JupyterLab renders them: one MIME type per output, HTML first."""
    images = tables = 0
    for cell in json.loads((ROOT / path).read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            tables += _tables_in_markdown("".join(cell["source"]))
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            images += "image/png" in data
            if "text/html" in data:
                tables += "".join(data["text/html"]).count("<table")
            elif "text/markdown" in data:
                tables += _tables_in_markdown("".join(data["text/markdown"]))
    return images, tables


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000"):
        opts.add_argument(arg)  # --no-sandbox: chromium refuses to run as root with its sandbox
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def test_the_executed_notebooks_render_their_figures_and_tables(server, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, token = server
    seen = {}
    for path in EXECUTED:
        images, tables = expected(path)
        assert images >= 1 and tables >= 1, path  # the notebook was executed and published with its outputs
        browser.get(f"{base}/lab/tree/{path}?token={token}")
        count = lambda css: len(browser.find_elements(By.CSS_SELECTOR, f".jp-NotebookPanel:not(.lm-mod-hidden) {css}"))  # noqa: E731
        try:
            WebDriverWait(browser, 90).until(lambda d: count(".jp-OutputArea-output img") >= images and count("table") >= tables)
        except Exception:
            pytest.fail(f"{path}: rendered {count('.jp-OutputArea-output img')} of {images} figures, "
                        f"{count('table')} of {tables} tables")
        seen[path] = {"figures": count(".jp-OutputArea-output img"), "tables": count("table"),
                      "expected_figures": images, "expected_tables": tables}
        assert (seen[path]["figures"], seen[path]["tables"]) == (images, tables), seen[path]
    OUT.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(OUT / "00_report.png"))  # the last one opened
    (OUT / "rendered.json").write_text(json.dumps(seen, indent=2) + "\n")
    print(json.dumps(seen))


def test_a_source_notebook_runs_top_to_bottom_on_the_servers_kernel(server) -> None:  # type: ignore[no-untyped-def]
    import websocket
    from jupyter_client.jsonutil import json_default
    from jupyter_client.session import Session

    base, token = server
    started = time.time()
    sess = _api(base, token, "/api/sessions", {"path": SOURCE, "type": "notebook", "name": Path(SOURCE).name,
                                               "kernel": {"name": "lowmem"}}, "POST")
    assert sess["kernel"]["name"] == "lowmem"
    ws = websocket.create_connection(f"{base.replace('http', 'ws')}/api/kernels/{sess['kernel']['id']}/channels",
                                     header=[f"Authorization: token {token}"], timeout=300)
    session = Session(username="test")
    try:
        cells = [c for c in json.loads((ROOT / SOURCE).read_text())["cells"] if c["cell_type"] == "code"]
        for i, cell in enumerate(cells):
            msg = session.msg("execute_request", {"code": "".join(cell["source"]), "silent": False, "store_history": True,
                                                  "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
            msg["channel"] = "shell"
            ws.send(json.dumps(msg, default=json_default))
            while True:
                reply = json.loads(ws.recv())
                if reply.get("parent_header", {}).get("msg_id") != msg["header"]["msg_id"]:
                    continue
                if reply["msg_type"] == "error":
                    pytest.fail(f"{SOURCE} cell {i}: {reply['content']['ename']}: {reply['content']['evalue']}")
                if reply["channel"] == "shell" and reply["msg_type"] == "execute_reply":
                    assert reply["content"]["status"] == "ok", reply["content"]
                    break
    finally:
        ws.close()
        _api(base, token, f"/api/sessions/{sess['id']}", method="DELETE")
    # What the last cell wrote into the notebook's own out_dir: the metrics the pipeline committed from the same inputs.
    written = ROOT / "data" / "smoke" / "metrics" / "combinations.json"
    assert written.stat().st_mtime >= started
    assert json.loads(written.read_text()) == json.loads((ROOT / "metrics" / "combinations.json").read_text())
