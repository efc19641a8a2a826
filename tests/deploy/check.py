"""Checks the deployment files in docs/deploy/.

- Kubernetes objects of the core API (ConfigMap, Deployment, Service) are
  validated, strictly (no unknown field), against the published Kubernetes
  schemas bundled by kubernetes-validate.
- The custom resources: every pod template inside a LeaderWorkerSet is
  validated as a core PodTemplate the same way; the LeaderWorkerSet's and
  the InferencePool's own fields against the v1 schemas in crd_schemas.py,
  no unknown field allowed, and, given `--crd FILE` (the published CRDs),
  against the CRDs' own OpenAPI schemas too. Edits of each resource must
  get the API's verdict from both.
- Consistency: the InferencePool selects the Deployment's pods on the port
  they serve; each LeaderWorkerSet's ConfigMap carries its docs/deploy/ TOML
  (tp3.toml, dp4.toml).
- The engine's side: `host config show`, given each pod's (or Slurm
  task's) command-line flags and the environment its launcher sets, yields
  the node place the group needs (nnodes, node_rank, master_addr; for
  data-parallel machines, the first engine-core rank and the API server).

Usage: python3 tests/deploy/check.py target/debug/host [--crd FILE]...
"""

import argparse
import os
import pathlib
import shlex
import subprocess
import tempfile
import tomllib

import jsonschema
import kubernetes_validate
import yaml

import crd_schemas

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "docs" / "deploy"
K8S_VERSION = "1.33.0"

def core(doc, what):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    print(f"ok  {what}: {doc['kind']} {doc['metadata']['name']} (Kubernetes {K8S_VERSION} schema, strict)")


def custom(doc, what, crds):
    """A custom resource against the schema here, the published CRD's when
    given, and the API's verdicts on edits of it."""
    kind = doc["kind"]
    jsonschema.validate(doc, crd_schemas.SCHEMAS[kind])
    against = "crd_schemas.py"
    if kind in crds:
        jsonschema.validate(doc, crds[kind])
        against += " and the published CRD"
    edits = crd_schemas.check_edits(kind, doc, crds.get(kind))
    print(f"ok  {what}: {kind} {doc['apiVersion']} against {against}; {edits} edits get the API's verdict")


def pod_template(template, what):
    wrapper = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "check"},
        "template": template,
    }
    kubernetes_validate.validate(wrapper, K8S_VERSION, strict=True)
    print(f"ok  {what} (as a core PodTemplate, strict)")


def host_config(host, argv, env):
    """What `host config show` makes of `host serve` flags `argv` under `env`."""
    assert argv[:2] == ["host", "serve"], f"not a `host serve` command: {argv}"
    flags = [a for a in argv[2:] if a != "--headless"]
    serve_only = {"--host", "--port", "--api-key"}
    kept, skip = [], False
    for a in flags:
        if skip:
            skip = False
        elif a in serve_only:
            skip = True
        else:
            kept.append(a)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LWS_", "SLURM_", "MASTER_"))}
    out = subprocess.run(
        [host, "config", "show", *kept],
        env={**clean, **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, f"host config show {kept} failed: {out.stderr}"
    return tomllib.loads(out.stdout)


def expect_place(config, nnodes, node_rank, master, what):
    p = config["parallel"]
    got = (p["nnodes"], p["node_rank"], p["master_addr"])
    assert got == (nnodes, node_rank, master), f"{what}: (nnodes, node_rank, master_addr) = {got}"
    print(f"ok  {what}: nnodes {nnodes}, node rank {node_rank}, master {master}")


def with_config_mounted(argv, configmap):
    """`argv` with /etc/host/<file> pointing at the ConfigMap's contents."""
    tmp = pathlib.Path(tempfile.mkdtemp())
    for name, text in configmap["data"].items():
        (tmp / name).write_text(text)
    return [a.replace("/etc/host", str(tmp)) for a in argv]


def check_lws(host, crds, file, toml_name, expect):
    """A LeaderWorkerSet file: its objects' schemas, its ConfigMap equal to
    docs/deploy/<toml_name>, and `expect(config, size, index, leader, what)`
    for what each pod's `host serve` makes of its launcher's environment."""
    docs = list(yaml.safe_load_all((DEPLOY / file).read_text()))
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    assert tomllib.loads(configmap["data"][toml_name]) == tomllib.loads(
        (DEPLOY / toml_name).read_text()
    ), f"the ConfigMap's {toml_name} differs from docs/deploy/{toml_name}"
    for doc in docs:
        if doc["kind"] != "LeaderWorkerSet":
            core(doc, file)
            continue
        custom(doc, file, crds)
        lwt = doc["spec"]["leaderWorkerTemplate"]
        size = lwt["size"]
        leader = f"{doc['metadata']['name']}-0.{doc['metadata']['name']}.default"
        for index, key in [(0, "leaderTemplate"), (1, "workerTemplate")]:
            pod_template(lwt[key], f"{file}: {key}")
            argv = with_config_mounted(lwt[key]["spec"]["containers"][0]["command"], configmap)
            env = {
                "LWS_LEADER_ADDRESS": leader,
                "LWS_GROUP_SIZE": str(size),
                "LWS_WORKER_INDEX": str(index),
            }
            config = host_config(host, argv, env)
            expect(config, size, index, leader, f"{file}: {key} as pod {index}")


def tensor_parallel_node(config, size, index, leader, what):
    expect_place(config, size, index, leader, what)
    assert config["parallel"]["tensor_parallel_size"] >= size


def data_parallel_machine(config, size, index, leader, what):
    p = config["parallel"]
    local = p["data_parallel_size_local"]
    assert local * size == p["data_parallel_size"], f"{what}: {size} pods do not hold every rank"
    got = (p["data_parallel_start_rank"], p["master_addr"], p["nnodes"])
    assert got == (index * local, leader, 1), f"{what}: (start rank, master_addr, nnodes) = {got}"
    print(f"ok  {what}: engine cores {index * local}..{(index + 1) * local}, API server {leader}")


def check_replicas(host, crds, docs):
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    core(deployment, "replicas.yaml")
    custom(pool, "replicas.yaml", crds)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items(), f"the pool selects {selector}, the pods carry {labels}"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    argv = container["command"]
    port = int(argv[argv.index("--port") + 1])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    assert port in [p["containerPort"] for p in container["ports"]]
    print(f"ok  replicas.yaml: the pool selects the Deployment's pods on port {port}")
    config = host_config(host, argv, {})
    assert config["kv_events"]["enable_kv_cache_events"] is True
    expect_place(config, 1, 0, "127.0.0.1", "replicas.yaml: each replica")


def check_slurm(host):
    script = (DEPLOY / "host.sbatch").read_text()
    subprocess.run(["bash", "-n", str(DEPLOY / "host.sbatch")], check=True)
    line = next(l for l in script.splitlines() if l.startswith("srun "))
    argv = shlex.split(line.replace('"$CONFIG"', "docs/deploy/tp3.toml"))
    argv = argv[argv.index("host"):]
    for rank in (0, 1):
        env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "cpu[07-08]"}
        config = host_config(host, argv, env)
        expect_place(config, 2, rank, "cpu07", f"host.sbatch: task {rank}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host", help="the `host` binary")
    parser.add_argument(
        "--crd",
        action="append",
        default=[],
        type=argparse.FileType("r"),
        help="a published CRD file (LeaderWorkerSet, InferencePool) to validate against too",
    )
    args = parser.parse_args()
    crds = {}
    for file in args.crd:
        try:
            kind, schema = crd_schemas.from_crd(file.read())
        except (ValueError, KeyError, TypeError, yaml.YAMLError) as e:
            parser.error(f"--crd {file.name} is not a usable CRD file: {e}")
        crds[kind] = schema
    host = args.host
    check_lws(host, crds, "leaderworkerset.yaml", "tp3.toml", tensor_parallel_node)
    check_lws(host, crds, "dp-leaderworkerset.yaml", "dp4.toml", data_parallel_machine)
    check_replicas(host, crds, list(yaml.safe_load_all((DEPLOY / "replicas.yaml").read_text())))
    check_slurm(host)
    print("deployment files: all checks passed")


if __name__ == "__main__":
    main()
