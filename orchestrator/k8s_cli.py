"""`rayft k8s render`: a RayJob (and the ConfigMap carrying its spec) for one job spec."""

from __future__ import annotations


def load_for_k8s(spec_path: str, overrides: list[str], kind: str):
    """The job spec (files=False: data paths resolve inside the image / on the PVC) and, for a
    search, the full search spec text that travels in the ConfigMap."""
    from pathlib import Path

    from jobs.spec import load_spec, read_yaml

    if kind == "tune":
        raw = read_yaml(spec_path)
        job = {k: v for k, v in raw.items() if k != "search"}
        return load_spec(spec_path, overrides, data=job, files=False), Path(spec_path).read_text()
    return load_spec(spec_path, overrides, files=False), None


def cmd_render(args) -> int:
    from .k8s import render_yaml

    spec, text = load_for_k8s(args.spec, args.overrides, args.kind)
    print(render_yaml(spec, queue=args.queue, image=args.image, overlay=args.overlay,
                      spec_path=args.spec, kind=args.kind, spec_text=text), end="")
    return 0


def add_k8s_target_args(p) -> None:
    """Arguments shared by `k8s render` and the kuberay backend of submit/status/logs/stop."""
    p.add_argument("--queue", help="Kueue LocalQueue name (default: the overlay's)")
    p.add_argument("--image", help="container image with rayft installed (default: the overlay's node type)")
    p.add_argument("--overlay", default="gpu", help="k8s/overlays/NAME whose node type the job must fit (default gpu)")


def register(sub) -> None:
    k8s = sub.add_parser("k8s", help="Kubernetes (KubeRay + Kueue) manifests")
    ksub = k8s.add_subparsers(dest="k8s_cmd", required=True)
    render = ksub.add_parser("render", help="print the RayJob (+ spec ConfigMap) for a job spec as YAML")
    render.add_argument("spec")
    render.add_argument("overrides", nargs="*", metavar="section.field=value")
    render.add_argument("--kind", choices=("finetune", "tune"), default="finetune",
                        help="a fine-tune (python -m jobs.finetune) or a search (rayft tune)")
    add_k8s_target_args(render)
    render.set_defaults(fn=cmd_render)
