"""The Edge's status page in a real browser (Playwright driving Debian's chromium).

Run by bins/tests/status_page.rs with: the page's URL, the admin token, the Edge's API URL and
key, the pid of the Node to kill, and the directory for the screenshots. Every check failing
raises; the last line printed is a JSON summary the Rust test reads.
"""

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from playwright.sync_api import sync_playwright

page_url, token, api_url, api_key, kill_pid, shots = sys.argv[1:7]
kill_pid = int(kill_pid)
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def chat(content, timeout=30, model="mesh-model"):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}]})
    req = urllib.request.Request(
        api_url + "/chat/completions",
        data=body.encode(),
        headers={"Authorization": "Bearer " + api_key, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:  # a stalled request may be cut
        return 0


def node_state(page, node):
    return page.locator(f'#nodes tr[data-node="{node}"] td:nth-child(2)').inner_text(timeout=5000)


def pairs_of(page, dl):
    dts = page.locator(dl + " dt").all_inner_texts()
    dds = page.locator(dl + " dd").all_inner_texts()
    return dict(zip(dts, dds))


def wait_js(page, expr, arg=None, timeout=10000):
    try:
        page.wait_for_function(expr, arg=arg, timeout=timeout)
    except Exception:
        # What the page was showing, for the failure's message.
        view = page.evaluate("() => fetch('api/status').then((r) => r.text())")
        raise AssertionError(f"waited for {expr}\nthe status view: {view}") from None


def traffic(page, label):
    dts = page.locator("#traffic dt").all_inner_texts()
    dds = page.locator("#traffic dd").all_inner_texts()
    return int(dict(zip(dts, dds))[label])


summary = {}
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])

    # No credential: no page.
    anonymous = browser.new_context()
    r = anonymous.request.get(page_url)
    assert r.status == 401, r.status
    assert "<table" not in r.text(), "an unauthenticated request got the page"
    # The browser itself, with nothing to answer the Basic challenge with, shows no page.
    blank = anonymous.new_page()
    try:
        r = blank.goto(page_url)
        assert r.status == 401, r.status
    except Exception as e:  # headless chromium: net::ERR_INVALID_AUTH_CREDENTIALS
        assert "ERR_INVALID_AUTH_CREDENTIALS" in str(e), e
    assert blank.locator("#nodes").count() == 0, "an unauthenticated browser got the page"
    anonymous.close()

    # With the admin token as the Basic password.
    ctx = browser.new_context(
        http_credentials={"username": "admin", "password": token},
        viewport={"width": 1280, "height": 800},
    )
    page = ctx.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    r = page.goto(page_url)
    assert r.status == 200, r.status
    csp = r.headers.get("content-security-policy", "")
    assert "default-src 'none'" in csp and "script-src 'self'" in csp, csp
    summary["csp"] = csp

    # Both Nodes ready, live.
    page.wait_for_selector("#live.pill-live", timeout=10000)
    for node in ("node-1", "node-2"):
        page.wait_for_function(
            "n => { const c = document.querySelector(`#nodes tr[data-node='${n}'] td:nth-child(2)`);"
            " return c && c.innerText.trim() === 'ready'; }",
            arg=node,
            timeout=10000,
        )

    # Each Node's version (from its registration) and when it was last heard from.
    for node in ("node-1", "node-2"):
        cells = page.locator(f'#nodes tr[data-node="{node}"] td').all_inner_texts()
        assert cells[3] not in ("", "–"), cells
        assert "s ago" in cells[5], cells
    summary["node_row"] = page.locator('#nodes tr[data-node="node-1"]').inner_text()

    # Requests move the traffic figures.
    before = traffic(page, "Requests answered")
    for _ in range(5):
        assert chat("hello") == 200
    page.wait_for_function(
        "b => { const d = [...document.querySelectorAll('#traffic dt')]"
        ".findIndex(x => x.innerText === 'Requests answered');"
        " return d >= 0 && Number(document.querySelectorAll('#traffic dd')[d].innerText) >= b + 5; }",
        arg=before,
        timeout=10000,
    )
    summary["requests_answered"] = traffic(page, "Requests answered")
    # ... and the key's use of its limits (12 requests a minute: one back every 5 s).
    wait_js(
        page,
        "() => { const c = document.querySelector('#keys tr[data-key=\"team-a\"] td:nth-child(2)');"
        " return c && Number(c.innerText.split(' / ')[0]) >= 4 && c.innerText.endsWith(' / 12'); }",
    )
    summary["key_requests"] = int(
        page.locator('#keys tr[data-key="team-a"] td:nth-child(2)').inner_text().split(" / ")[0]
    )
    summary["key_row"] = page.locator('#keys tr[data-key="team-a"]').inner_text()
    # An error answer shows under its kind.
    assert chat("hello", model="no-such-model") == 404
    wait_js(page, "() => [...document.querySelectorAll('#traffic dt')].some(d => d.innerText === 'Errors: not found')")
    # The gateway's own overhead and time to first content, from those requests.
    page.wait_for_function(
        "() => document.getElementById('overhead').innerText.endsWith(' ms')"
        " && document.getElementById('ttft').innerText.endsWith(' ms')",
        timeout=10000,
    )
    summary["overhead"] = page.inner_text("#overhead")
    summary["ttft"] = page.inner_text("#ttft")
    page.screenshot(path=os.path.join(shots, "edge-1280x800.png"), full_page=True)

    # A stalled provider shows its overlay: the upstream never answers "stall".
    t = threading.Thread(target=chat, args=("stall", 15), daemon=True)
    t.start()
    page.wait_for_selector('#providers tr td .pill-unavailable', timeout=15000)
    stalled = page.locator("#providers tr:has(.pill-unavailable)").first
    summary["stalled_row"] = stalled.inner_text()
    # Its cause and since when.
    summary["stalled_cause"] = stalled.locator("td:nth-child(6)").inner_text()
    assert stalled.locator("td:nth-child(3)").inner_text() == "mesh-model", summary
    assert "stalled" in summary["stalled_cause"] and "since" in summary["stalled_cause"], summary
    stalled_node = stalled.get_attribute("data-node")
    page.screenshot(path=os.path.join(shots, "edge-stalled-1280x800.png"), full_page=True)

    # Drill-down on that provider, then the one action: its Node probes its providers, after
    # the operator confirms. Its upstream still fails, so the overlay stays and the probe's
    # answer shows.
    stalled.click()
    page.wait_for_selector("#provider-detail:not([hidden])", timeout=5000)
    assert "ago" in pairs_of(page, "#provider-detail-pairs")["Unavailable since"]
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    page.click(f'#nodes tr[data-node="{stalled_node}"]')
    page.wait_for_selector("#node-actions:not([hidden])", timeout=5000)
    page.click("#probe")
    wait_js(page, "() => document.getElementById('probe-result').innerText.startsWith('probed')", timeout=15000)
    assert dialogs and stalled_node in dialogs[0], dialogs
    wait_js(
        page,
        "() => [...document.querySelectorAll('#provider-detail-pairs dt')].some((d) => d.innerText === 'Last recovery probe'"
        " && d.nextElementSibling.innerText.startsWith('unavailable'))",
        timeout=10000,
    )
    summary["probe"] = pairs_of(page, "#provider-detail-pairs")["Last recovery probe"]
    assert summary["probe"].startswith("unavailable"), summary
    page.screenshot(path=os.path.join(shots, "edge-provider-1280x800.png"), full_page=True)
    page.click(f'#nodes tr[data-node="{stalled_node}"]')  # back to all Nodes

    # Drill-down: one Node's providers.
    page.click('#nodes tr[data-node="node-1"]')
    page.wait_for_function(
        "() => document.getElementById('provider-filter').innerText.includes('node-1')",
        timeout=5000,
    )
    shown = page.locator("#providers tbody tr").all_inner_texts()
    assert shown and all("node-1" in row for row in shown), shown
    page.click('#nodes tr[data-node="node-1"]')

    # Kill a Node: its row turns red without a reload.
    reloads = []
    page.on("framenavigated", lambda f: reloads.append(f.url) if f == page.main_frame else None)
    killed_at = time.monotonic()
    os.kill(kill_pid, signal.SIGKILL)
    page.wait_for_selector('#nodes tr.state-down[data-node="node-2"]', timeout=20000)
    summary["red_after_s"] = round(time.monotonic() - killed_at, 3)
    assert not reloads, reloads
    color = page.evaluate(
        "() => getComputedStyle(document.querySelector(\"#nodes tr[data-node='node-2'] .pill\")).backgroundColor"
    )
    assert color == "rgb(207, 34, 46)", color
    page.screenshot(path=os.path.join(shots, "edge-node-down-1280x800.png"), full_page=True)

    # A phone's width.
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)
    page.screenshot(path=os.path.join(shots, "edge-390x844.png"), full_page=True)

    assert not errors, errors
    summary["console_errors"] = errors
    ctx.close()
    browser.close()

print(json.dumps(summary))
