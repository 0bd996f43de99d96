"""Each instance's own numbers from its /metrics: vLLM's names read, data-parallel engines combined, a server that
does not answer said in one line (the last good values kept), never a crash of the view."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvscope.sources.fleet_metrics import MetricsScraper, parse_metrics

PAGE = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
"""


def test_vllms_names_are_read_and_engines_combined():
    assert parse_metrics(PAGE) == {
        "kv_cache_usage_perc": 0.5,
        "num_requests_running": 5.0,
        "num_requests_waiting": 1.0,
    }  # the mean of usage, the sum of requests
    assert parse_metrics("") == {}


def test_the_scraper_reads_a_server_and_says_in_one_line_when_it_stops_answering():
    class Page(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    scraper = MetricsScraper({"a": url}, interval=0.05, timeout=0.5)
    try:
        deadline = time.monotonic() + 10
        while scraper.get("a") is None:
            assert time.monotonic() < deadline
        good = scraper.get("a")
        assert good.values["num_requests_running"] == 5.0 and good.error is None
        server.shutdown()
        server.server_close()
        while scraper.get("a").error is None:
            assert time.monotonic() < deadline
        bad = scraper.get("a")
        assert bad.values == good.values and bad.error.startswith(url) and "\n" not in bad.error
        assert bad.as_dict(time.monotonic())["error"] == bad.error
    finally:
        scraper.close()
    assert not scraper._thread.is_alive()
