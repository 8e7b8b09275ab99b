"""iop-cp's status page in a real browser (Playwright driving Debian's chromium).

Arguments: the page's URL, the admin token, the iop-cp binary, its data directory, the token
id the test created, and the directory for screenshots. The slot is rotated here with the CLI
while the page is open; the page must show it without a reload. The last line printed is a
JSON summary.
"""

import json
import os
import subprocess
import sys

from playwright.sync_api import sync_playwright

page_url, admin_token, iop_cp, data_dir, token_id, shots = sys.argv[1:7]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

def wait_js(page, expr, arg=None, timeout=10000):
    try:
        page.wait_for_function(expr, arg=arg, timeout=timeout)
    except Exception:
        # What the page was showing, for the failure's message.
        view = page.evaluate("() => fetch('api/status').then((r) => r.text())")
        raise AssertionError(f"waited for {expr}\nthe status view: {view}") from None


summary = {}
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])

    anonymous = browser.new_context()
    r = anonymous.request.get(page_url)
    assert r.status == 401, r.status
    assert "<table" not in r.text()
    anonymous.close()

    ctx = browser.new_context(
        http_credentials={"username": "admin", "password": admin_token},
        viewport={"width": 1280, "height": 800},
    )
    page = ctx.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    r = page.goto(page_url)
    assert r.status == 200, r.status
    csp = r.headers.get("content-security-policy", "")
    assert "default-src 'none'" in csp, csp
    page.wait_for_selector("#live.pill-live", timeout=10000)

    # The connected Edge, with the generation it acknowledged: the store's.
    wait_js(
        page,
        "() => { const r = document.querySelector('#edges tr[data-edge=\"edge-1\"]');"
        " return r && r.children[1].innerText === document.getElementById('generation').innerText; }",
        timeout=30000,
    )
    summary["edge_row"] = page.inner_text('#edges tr[data-edge="edge-1"]')

    # The token the CLI created, by id.
    page.wait_for_selector(f'#tokens tr[data-token="{token_id}"]', timeout=10000)
    summary["token_row"] = page.inner_text(f'#tokens tr[data-token="{token_id}"]')
    before = int(page.inner_text('#slots tr[data-slot="openai-prod"] td:nth-child(4)'))

    # Rotate the slot with the CLI; the page follows.
    env = dict(os.environ, ROTATED_SECRET="sk-rotated-cp-page-secret-0123")
    subprocess.run(
        [iop_cp, "--data-dir", data_dir, "slot", "put", "openai-prod", "--profile", "openai",
         "--credential-env", "ROTATED_SECRET"],
        check=True, env=env, capture_output=True,
    )
    page.wait_for_function(
        "b => Number(document.querySelector(\"#slots tr[data-slot='openai-prod'] td:nth-child(4)\").innerText) > b",
        arg=before,
        timeout=10000,
    )
    summary["slot_revision"] = [before, int(page.inner_text('#slots tr[data-slot="openai-prod"] td:nth-child(4)'))]
    summary["slot_last_put"] = page.inner_text('#slots tr[data-slot="openai-prod"] td:nth-child(5)')
    # When it was put: a time a few seconds ago, and its generation.
    assert "s ago" in summary["slot_last_put"] and "generation" in summary["slot_last_put"], summary
    created = page.inner_text(f'#tokens tr[data-token="{token_id}"] td:nth-child(4)')
    assert "ago" in created and "generation" in created, created
    # The Edge follows the new generation (behind by 0 again).
    wait_js(
        page,
        "() => { const r = document.querySelector('#edges tr[data-edge=\"edge-1\"]');"
        " return r && r.children[1].innerText === document.getElementById('generation').innerText; }",
        timeout=30000,
    )
    page.wait_for_function(
        "() => [...document.querySelectorAll('#mutations td')].some(td => td.innerText === 'put_slot')",
        timeout=10000,
    )
    page.screenshot(path=os.path.join(shots, "cp-1280x800.png"), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)
    page.screenshot(path=os.path.join(shots, "cp-390x844.png"), full_page=True)
    assert not errors, errors
    ctx.close()
    browser.close()

print(json.dumps(summary))
