"""Several supervised replicas (scripts/launch_server.py each: tritonserver + the OpenAI API) behind nginx, which
sends every request for one adapter to the same replica (consistent hashing on the request's `model`), so that an
adapter is uploaded to, and kept warm on, one replica only.

    python scripts/replicas.py [--replicas 3] [--port 9000] [--base-port 9100] [--balance hash|round-robin]
        [--model-dir DIR] [--adapter-store DIR] [-- launch_server.py options]
Replica i serves on base-port + 10 i + (0 HTTP, 1 gRPC, 2 metrics, 3 OpenAI); nginx on --port (OpenAI API only).
nginx comes from Debian (scripts/replicas.sh installs it); it runs as a child with its own config in .run/replicas.
"""
import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from server_process import is_ready
from supervisor import Service, supervise

ROOT = Path(__file__).resolve().parent.parent
# the adapter a request names: `model` in its JSON body (nginx reads the body before it picks the replica); the
# base model's `<base>_lora_<adapter>` spelling hashes with the adapter's own name
NGINX_CONF = """worker_processes 1;
daemon off;
pid {run}/nginx.pid;
error_log {run}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {run}/body;
  proxy_temp_path {run}/proxy;
  client_max_body_size 32m;
  client_body_buffer_size 32m;
  map $request_body $adapter {{
    default "";
    "~\\"model\\"\\s*:\\s*\\"(?:[^\\"]*{separator})?(?<name>[^\\"]*)\\"" $name;
  }}
  upstream replicas {{
    {balance}
{servers}
  }}
  server {{
    listen {host}:{port};
    location / {{
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 3600s;
    }}
  }}
}}
"""


def log(line: str) -> None:
    print(f"[replicas] {line}", flush=True)


def nginx_conf(run: Path, host: str, port: int, openai_ports: list[int], balance: str, separator: str) -> str:
    servers = "\n".join(f"    server 127.0.0.1:{p} max_fails=0;" for p in openai_ports)
    rule = "hash $adapter consistent;" if balance == "hash" else "# round-robin"
    return NGINX_CONF.format(run=run, host=host, port=port, servers=servers, balance=rule, separator=separator)


def replica(i: int, args, rest: list[str]) -> Service:
    http, grpc, metrics, openai = (args.base_port + 10 * i + k for k in range(4))
    cmd = [sys.executable, "-u", str(ROOT / "scripts" / "launch_server.py"), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai), *rest]
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    if args.adapter_store:
        cmd += ["--adapter-store", args.adapter_store]
    return Service(f"replica {i}", lambda: subprocess.Popen(cmd, cwd=ROOT),
                   ready=lambda process: is_ready(openai, "/health"),
                   on_ready=lambda restarts: print(f"[replicas] replica {i} ready: OpenAI http://127.0.0.1:{openai}/v1,"
                                                   f" metrics http://127.0.0.1:{openai}/metrics", flush=True),
                   grace_s=45, log=log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--host", default="127.0.0.1", help="nginx's address")
    parser.add_argument("--port", type=int, default=9000, help="nginx: the OpenAI API of every replica")
    parser.add_argument("--base-port", type=int, default=9100)
    parser.add_argument("--balance", choices=("hash", "round-robin"), default="hash",
                        help="hash: each adapter on one replica (consistent hashing); round-robin: nginx's default")
    parser.add_argument("--lora-separator", default="_lora_")
    parser.add_argument("--model-dir")
    parser.add_argument("--adapter-store")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        sys.exit("nginx is not installed: scripts/replicas.sh installs it (Debian package nginx-light)")
    run = ROOT / ".run" / f"replicas-{args.port}"
    run.mkdir(parents=True, exist_ok=True)
    openai_ports = [args.base_port + 10 * i + 3 for i in range(args.replicas)]
    (run / "nginx.conf").write_text(nginx_conf(run, args.host, args.port, openai_ports, args.balance,
                                               args.lora_separator))
    balancer = Service("nginx", lambda: subprocess.Popen([nginx, "-c", str(run / "nginx.conf"), "-p", str(run)]),
                       ready=lambda process: True, grace_s=10, log=log,
                       on_ready=lambda restarts: print(f"[replicas] nginx on http://{args.host}:{args.port}/v1 "
                                                       f"({args.balance}) over {args.replicas} replicas", flush=True))
    sys.exit(supervise([balancer] + [replica(i, args, rest) for i in range(args.replicas)]))


if __name__ == "__main__":
    main()
