"""`rayft k8s render`: a RayJob (and the ConfigMap carrying its spec) for one job spec."""

from __future__ import annotations

import argparse
import re

from jobs.errors import error_line

from . import Parser


def cmd_render(args) -> int:
    from orchestrator.backends.kuberay.render import load_spec_for_k8s, render_yaml

    k = load_spec_for_k8s(args.spec, args.overrides, args.kind)
    print(
        render_yaml(
            k.spec,
            queue=args.queue,
            image=args.image,
            overlay=args.overlay,
            spec_path=args.spec,
            kind=k.kind,
            spec_text=k.spec_text,
            entrypoint_overrides=k.entrypoint_overrides,
            concurrent_trials=k.concurrent_trials,
        ),
        end="",
    )
    return 0


# A Kubernetes label value (the queue name goes into the `kueue.x-k8s.io/queue-name` label).
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def queue_name(text: str) -> str:
    """`--queue`: a Kueue LocalQueue name, which must be a valid label value. (A credential given
    here is refused by the manifests' policy check, `kuberay.policy`, and never echoed.)"""
    if not LABEL_VALUE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{error_line(repr(text))} is not a valid label value (at most 63 letters, digits, '-', '_', '.', "
            "starting and ending with a letter or digit)"
        )
    return text


def add_k8s_target_args(p) -> None:
    """Arguments shared by `k8s render` and `rayft submit --backend kuberay`."""
    p.add_argument(
        "--queue", type=queue_name, help="kuberay: Kueue LocalQueue name (default: rayft, the overlays' LocalQueue)"
    )
    p.add_argument(
        "--image",
        help="kuberay: container image with rayft installed, REPO:TAG (pulled Always) or "
        "REPO@sha256:DIGEST (pulled IfNotPresent) (default: the overlay's node type)",
    )
    p.add_argument(
        "--overlay",
        default="gpu",
        help="kuberay: k8s/overlays/NAME whose node type the job must fit and whose GPU label, "
        "tolerations and flavour it uses: gpu, gke, eks, onprem, dev-cpu (default gpu)",
    )


def register(sub) -> None:
    k8s = sub.add_parser("k8s", help="Kubernetes (KubeRay + Kueue) manifests")
    ksub = k8s.add_subparsers(dest="k8s_cmd", required=True, parser_class=Parser)
    render = ksub.add_parser("render", help="print the RayJob (+ spec ConfigMap) for a job spec as YAML")
    render.add_argument("spec")
    render.add_argument("overrides", nargs="*", metavar="section.field=value")
    render.add_argument(
        "--kind",
        choices=("finetune", "tune"),
        default="finetune",
        help="a fine-tune (python -m jobs.finetune) or a search (rayft tune: a search spec)",
    )
    add_k8s_target_args(render)
    render.set_defaults(fn=cmd_render)
