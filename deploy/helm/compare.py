#!/usr/bin/env python3
"""The Helm chart deploys what the kustomize kit deploys.

Renders deploy/helm/volume-reconciler (`helm template`) and the kustomize
kit (`kubectl kustomize`) for each case in CASES, and compares every object
field by field: kind and name, the containers' args, env, ports, probes,
security contexts, resources, volumes and mounts, the Job's command,
the services, the budget, the network policy, the settings file (as TOML).
Prints each difference with its path and exits 1 on any. The differences a
chart makes by being a chart are removed first, by the rules in ALLOWED,
each with its reason; nothing else is ignored.

Also checks that every value in values.yaml is documented by a comment
(the value's own, or a parent's), that every selector of the chart selects
a pod it renders, and that the chart's version is its appVersion.

    deploy/helm/compare.py [--helm PATH] [--kustomize 'kubectl kustomize']
    deploy/helm/compare.py --self-test     # the comparison is not blind

Needs Python 3.11 (tomllib) and PyYAML.
"""

import argparse
import copy
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/volume-reconciler"
KIT = ROOT / "deploy/kubernetes"
# The release's name and namespace as the kit has them: the base's objects
# are named volume-reconciler, and the CSI overlay reaches the service at
# volume-reconciler.volume-reconciler.svc.
RELEASE = "volume-reconciler"
NAMESPACE = "volume-reconciler"

# Each case: the chart's values, and the kustomize directories whose
# objects together are what the chart must render.
CASES = {
    "default values": ([], ["base", "migrate"]),
    "csi.enabled=true": (["--set", "csi.enabled=true"], ["base", "migrate", "csi-attach"]),
}

# What the chart may add where the kit has nothing, and why. A key the kit
# also has is compared like any other field.
ALLOWED_LABELS = {
    "helm.sh/chart": "Helm's standard label: which chart and version made the object",
    "app.kubernetes.io/managed-by": "Helm's standard label: Helm manages the object",
    "app.kubernetes.io/version": "Helm's standard label: the version of the service the object deploys",
    "app.kubernetes.io/instance": "the release's name, in labels and in every selector: two releases in one namespace never select each other's pods",
    "app.kubernetes.io/name": "the chart labels every object it makes; kustomize's configMapGenerator makes the ConfigMap without labels",
}
ALLOWED_ANNOTATIONS = {
    "helm.sh/hook": "the migrate Job runs as a hook (post-install, pre-upgrade): every helm upgrade runs it before the rollout and waits for it",
    "helm.sh/hook-delete-policy": "the previous migrate Job is deleted when the next starts, so that an upgrade to the same release migrates again",
    "checksum/config": "the pod template carries the settings' checksum so that a change of config rolls the pods (the kit's generated ConfigMap name has its hash instead)",
    "helm.sh/resource-policy": "cinder-csi's controller Deployment is kept when the release is uninstalled or csi turned off",
}
ALLOWED = [
    *(f"label {k}: {v}" for k, v in ALLOWED_LABELS.items()),
    *(f"annotation {k}: {v}" for k, v in ALLOWED_ANNOTATIONS.items()),
    "the ConfigMap's name: kustomize's configMapGenerator appends a hash of the content (-xxxxxxxxxx); the chart names it plainly and puts the checksum on the pod template",
    "config.toml: compared as TOML (the chart writes it from values: key order, quoting, no comments)",
    "a volume naming no source is emptyDir: {} (what the API server makes of it; kustomize drops the stand-in's `emptyDir:` null, the chart writes {})",
]

# Lists whose items are named: compared by that key, so that a difference
# names its item. Env's order matters too ($(VAR) refers to earlier ones).
LIST_KEYS = {"volumeMounts": "mountPath"}
ORDERED_NAMED_LISTS = {"env"}


def render_chart(helm, values):
    cmd = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values]
    return objects(run(cmd), " ".join(cmd))


def render_kit(kustomize, dirs):
    out = []
    for d in dirs:
        cmd = [*shlex.split(kustomize), str(KIT / d)]
        out += objects(run(cmd), " ".join(cmd))
    return out


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr}")
    return p.stdout


def objects(text, source):
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d:
            sys.exit(f"error: {source} rendered something that is not an object: {d!r}")
    return docs


def ident(obj):
    md = obj.get("metadata", {})
    ns = md.get("namespace")
    return f"{obj['kind']}/{ns + '/' if ns else ''}{md.get('name')}"


# ------------------------------------------------------- the allowed rules


def strip_allowed(kit_objs, chart_objs):
    """Both sides as copies, with ALLOWED's differences taken out."""
    kit, chart = copy.deepcopy(kit_objs), copy.deepcopy(chart_objs)
    unhash_configmaps(kit)
    for objs in (kit, chart):
        for o in objs:
            walk_volumes(o, default_empty_dir)
            if o["kind"] == "ConfigMap" and "config.toml" in o.get("data", {}):
                o["data"]["config.toml"] = parse_toml(o["data"]["config.toml"], ident(o))
    kit_by = {ident(o): o for o in kit}
    for o in chart:
        twin = kit_by.get(ident(o))
        if twin is not None:
            drop_chart_only(twin, o)
    return kit, chart


def unhash_configmaps(kit):
    """volume-reconciler-config-gb5k8885bc → volume-reconciler-config, the
    object's name and every reference to it."""
    renamed = {}
    for o in kit:
        name = o["metadata"]["name"]
        m = re.fullmatch(r"(.+)-[a-z0-9]{10}", name)
        if o["kind"] == "ConfigMap" and m:
            renamed[name] = m.group(1)
            o["metadata"]["name"] = m.group(1)

    def sub(v):
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [sub(x) for x in v]
        return renamed.get(v, v) if isinstance(v, str) else v

    for i, o in enumerate(kit):
        if o["kind"] != "ConfigMap":
            kit[i] = sub(o)


def walk_volumes(v, fn):
    if isinstance(v, dict):
        for k, x in v.items():
            if k == "volumes" and isinstance(x, list):
                for vol in x:
                    fn(vol)
            else:
                walk_volumes(x, fn)
    elif isinstance(v, list):
        for x in v:
            walk_volumes(x, fn)


def default_empty_dir(vol):
    if set(vol) == {"name"} or (set(vol) == {"name", "emptyDir"} and vol["emptyDir"] is None):
        vol["emptyDir"] = {}


def parse_toml(text, where):
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        sys.exit(f"error: {where}: config.toml is not TOML: {e}")


def drop_chart_only(kit, chart):
    """Removes from `chart` the allowed labels and annotations that `kit`
    lacks, wherever labels, selectors and annotations are."""
    if isinstance(kit, dict) and isinstance(chart, dict):
        for key, allowed in (
            ("labels", ALLOWED_LABELS),
            ("matchLabels", ALLOWED_LABELS),
            ("annotations", ALLOWED_ANNOTATIONS),
        ):
            if isinstance(chart.get(key), dict):
                drop_keys(kit.get(key), chart, key, allowed)
        # A Service's selector is a plain map of labels.
        if chart.get("kind") == "Service" and isinstance(chart.get("spec", {}).get("selector"), dict):
            drop_keys(kit.get("spec", {}).get("selector"), chart["spec"], "selector", ALLOWED_LABELS)
        for k in chart:
            if k in kit:
                drop_chart_only(kit[k], chart[k])
    elif isinstance(kit, list) and isinstance(chart, list):
        kit_named, chart_named = named(kit, None), named(chart, None)
        if kit_named is not None and chart_named is not None:
            for n, c in chart_named.items():
                if n in kit_named:
                    drop_chart_only(kit_named[n], c)
        else:
            for k, c in zip(kit, chart):
                drop_chart_only(k, c)


def drop_keys(kit_map, holder, key, allowed):
    """`kit_map` None: the kit has no such map, so an emptied one goes too."""
    m = holder[key]
    for k in [k for k in m if k in allowed and k not in (kit_map or {})]:
        if k == "app.kubernetes.io/instance" and m[k] != RELEASE:
            continue  # a wrong release name is a difference
        del m[k]
    if not m and kit_map is None:
        del holder[key]


# ------------------------------------------------------------ the compare


def named(items, parent_key):
    """A list of named items as {name: item}, or None when it is not one."""
    key = LIST_KEYS.get(parent_key, "name")
    if not items or not all(isinstance(i, dict) and key in i for i in items):
        return None
    out = {i[key]: i for i in items}
    return out if len(out) == len(items) else None


def show(v):
    return yaml.safe_dump(v, default_flow_style=True, width=1 << 20).strip().removesuffix("...").strip()


def diff(kit, chart, path, out, parent_key=None):
    if isinstance(kit, dict) and isinstance(chart, dict):
        for k in sorted(set(kit) | set(chart), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in chart:
                out.append(f"{p}: only in kustomize: {show(kit[k])}")
            elif k not in kit:
                out.append(f"{p}: only in the chart: {show(chart[k])}")
            else:
                diff(kit[k], chart[k], p, out, k)
    elif isinstance(kit, list) and isinstance(chart, list):
        kn, cn = named(kit, parent_key), named(chart, parent_key)
        if kn is not None and cn is not None:
            for n in list(kn) + [n for n in cn if n not in kn]:
                p = f"{path}[{n}]"
                if n not in cn:
                    out.append(f"{p}: only in kustomize: {show(kn[n])}")
                elif n not in kn:
                    out.append(f"{p}: only in the chart: {show(cn[n])}")
                else:
                    diff(kn[n], cn[n], p, out)
            if parent_key in ORDERED_NAMED_LISTS and list(kn) != list(cn) and set(kn) == set(cn):
                out.append(f"{path}: in another order: kustomize {list(kn)}, chart {list(cn)}")
        elif len(kit) != len(chart):
            out.append(f"{path}: kustomize {show(kit)}, chart {show(chart)}")
        else:
            for i, (k, c) in enumerate(zip(kit, chart)):
                diff(k, c, f"{path}[{i}]", out)
    elif type(kit) is not type(chart) or kit != chart:
        out.append(f"{path}: kustomize {show(kit)}, chart {show(chart)}")


def compare(kit_objs, chart_objs):
    kit, chart = strip_allowed(kit_objs, chart_objs)
    kit_by, chart_by = {ident(o): o for o in kit}, {ident(o): o for o in chart}
    out = []
    for name in kit_by:
        if name not in chart_by:
            out.append(f"{name}: only in kustomize")
    for name in chart_by:
        if name not in kit_by:
            out.append(f"{name}: only in the chart")
    for name in kit_by:
        if name in chart_by:
            d = []
            diff(kit_by[name], chart_by[name], "", d)
            out += [f"{name}: {x}" for x in d]
    return out


# ------------------------------------------------------- the other checks


def selectors_select(chart_objs):
    """Every selector of the chart selects pods of a workload it renders."""
    pods = []
    for o in chart_objs:
        if o["kind"] in ("Deployment", "Job"):
            ns = o["metadata"].get("namespace")
            pods.append((ns, o["spec"]["template"]["metadata"].get("labels", {})))
    out = []
    for o in chart_objs:
        spec, ns = o.get("spec", {}), o["metadata"].get("namespace")
        sels = []
        if o["kind"] == "Service":
            sels.append(("spec.selector", spec.get("selector")))
        if o["kind"] in ("Deployment", "PodDisruptionBudget"):
            sels.append(("spec.selector.matchLabels", spec.get("selector", {}).get("matchLabels")))
        if o["kind"] == "NetworkPolicy":
            sels.append(("spec.podSelector.matchLabels", spec.get("podSelector", {}).get("matchLabels")))
        for i, t in enumerate(spec.get("template", {}).get("spec", {}).get("topologySpreadConstraints", [])):
            sels.append((f"topologySpreadConstraints[{i}]", t.get("labelSelector", {}).get("matchLabels")))
        for where, sel in sels:
            if not sel or not any(pns == ns and sel.items() <= labels.items() for pns, labels in pods):
                out.append(f"{ident(o)}: {where} {show(sel)} selects no pod the chart renders")
    return out


def values_documented(text):
    """Every value in values.yaml has a comment above it, or a parent has."""
    lines = text.splitlines()
    out, stack = [], []  # stack: (indent, key, documented)
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z0-9_.-]+):(.*)$", line)
        if not m or line.lstrip().startswith("#"):
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        above = lines[i - 1].strip() if i > 0 else ""
        documented = above.startswith("#") or any(d for _, _, d in stack)
        stack.append((indent, key, documented))
        leaf = m.group(3).strip() != "" or i + 1 >= len(lines) or leading(lines[i + 1]) <= indent
        if leaf and not documented:
            out.append(f"values.yaml:{i + 1}: {'.'.join(k for _, k, _ in stack)} has no comment (nor has a parent)")
    return out


def leading(line):
    return len(line) - len(line.lstrip()) if line.strip() else 1 << 30


def chart_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    if str(chart["version"]) != str(chart["appVersion"]):
        return [f"Chart.yaml: version {chart['version']} is not appVersion {chart['appVersion']} (one release, one chart)"]
    return []


# -------------------------------------------------------------- self-test


def self_test(helm, kustomize):
    """The comparison finds a changed probe, a changed flag, a missing
    object and an extra label, and nothing in a render against itself."""
    kit = render_kit(kustomize, ["base", "migrate"])
    chart = render_chart(helm, [])
    if found := compare(chart, copy.deepcopy(chart)):
        sys.exit(f"self-test: the chart's render differs from itself: {found}")
    for mutate, expect in [
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"].update(periodSeconds=5),
         "Deployment/volume-reconciler: spec.template.spec.containers[volume-reconciler].readinessProbe.periodSeconds: kustomize 1, chart 5"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"].append("--verbose"),
         "Deployment/volume-reconciler: spec.template.spec.containers[volume-reconciler].args: kustomize [serve], chart [serve, --verbose]"),
        (lambda d: d["metadata"]["labels"].update({"team": "storage"}),
         "Deployment/volume-reconciler: metadata.labels.team: only in the chart: storage"),
        (lambda d: d["spec"]["template"]["metadata"]["labels"].update({"app.kubernetes.io/instance": "other"}),
         "Deployment/volume-reconciler: spec.template.metadata.labels.app.kubernetes.io/instance: only in the chart: other"),
    ]:
        mutated = copy.deepcopy(chart)
        mutate(next(o for o in mutated if o["kind"] == "Deployment"))
        if (found := compare(kit, mutated)) != [expect]:
            sys.exit(f"self-test: expected [{expect}], found {found}")
    expect = ["PodDisruptionBudget/volume-reconciler: only in kustomize"]
    if (found := compare(kit, [o for o in chart if o["kind"] != "PodDisruptionBudget"])) != expect:
        sys.exit(f"self-test: expected {expect}, found {found}")
    undocumented = "# -- documented\na: 1\nb:\n  # -- documented\n  c: 2\n  d: [3]\n# -- all of e\ne:\n  f: 4\n"
    expect = ["values.yaml:6: b.d has no comment (nor has a parent)"]
    if (found := values_documented(undocumented)) != expect:
        sys.exit(f"self-test: expected {expect}, found {found}")
    astray = copy.deepcopy(chart)
    next(o for o in astray if o["kind"] == "Service")["spec"]["selector"]["app.kubernetes.io/component"] = "sever"
    if len(found := selectors_select(astray)) != 1 or "selects no pod" not in found[0]:
        sys.exit(f"self-test: a Service selecting no pod: found {found}")
    print("self-test: a probe, a flag, a label, a release name, a missing object, an undocumented value and a selector astray are found; a render equals itself")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--helm", default="helm", help="the helm binary (default: helm on PATH)")
    ap.add_argument("--kustomize", default="kubectl kustomize", help="the kustomize command (default: kubectl kustomize)")
    ap.add_argument("--self-test", action="store_true", help="check that the comparison finds differences")
    args = ap.parse_args()
    if args.self_test:
        self_test(args.helm, args.kustomize)
        return 0
    problems = values_documented((CHART / "values.yaml").read_text()) + chart_version()
    for case, (values, dirs) in CASES.items():
        chart = render_chart(args.helm, values)
        kit = render_kit(args.kustomize, dirs)
        found = compare(kit, chart) + selectors_select(chart)
        print(f"{case}: {len(chart)} objects rendered by the chart, {len(kit)} by kustomize ({', '.join(dirs)}): {len(found)} differences")
        problems += [f"[{case}] {x}" for x in found]
    if problems:
        print(f"\nFAIL: {len(problems)} differences between the chart and the kustomize kit:")
        for p in problems:
            print(f"  {p}")
    else:
        print("the chart renders what the kit renders")
    print("differences allowed (removed before comparing):")
    for a in ALLOWED:
        print(f"  - {a}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
