"""The shipped deployment files: deploy/k8s.yaml is a Deployment whose start-up and readiness
probes hit /health, its liveness probe /health_generate (waiting longer than the server's own
timeout), and a Service selecting its pods; deploy/nginx.conf has the settings streaming and
balancing need."""

from __future__ import annotations

import os

import yaml

from eagleserve.server.api import health_timeout_s

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_k8s_deployment_and_service() -> None:
    with open(os.path.join(REPO, "deploy", "k8s.yaml")) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    deploy, service = docs["Deployment"], docs["Service"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"] == labels == service["spec"]["selector"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    liveness = container["livenessProbe"]
    assert liveness["httpGet"]["path"] == "/health_generate"
    assert liveness["timeoutSeconds"] > health_timeout_s()
    port = container["ports"][0]["name"]
    assert service["spec"]["ports"][0]["targetPort"] == port
    env = {e["name"] for e in container["env"]}
    assert "EAGLESERVE_API_KEY" in env


def test_nginx_conf_streams_and_balances() -> None:
    with open(os.path.join(REPO, "deploy", "nginx.conf")) as f:
        words = [" ".join(line.split("#")[0].split()) for line in f]
    for setting in ("least_conn;", "proxy_buffering off;", "proxy_http_version 1.1;",
                    "proxy_read_timeout 3600s;", "location = /health {",
                    "proxy_set_header Authorization $http_authorization;",
                    'proxy_set_header Connection "";'):  # fmt: skip
        assert setting in words, setting
