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
            access=access_flags(args),
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


def k8s_name(flag: str):
    """An argparse `type`: a Kubernetes object name (a Secret's, a ServiceAccount's); the value is
    not echoed when refused (a secret pasted into the wrong flag stays off the terminal)."""

    def parse(text: str) -> str:
        from orchestrator.backends.kuberay.object_storage import K8S_NAME

        if not K8S_NAME.fullmatch(text):
            raise argparse.ArgumentTypeError(
                "not a Kubernetes object name (lowercase letters, digits, '-' and '.', starting and ending "
                "with a letter or digit, at most 253)"
            )
        return text

    parse.__name__ = flag  # argparse names the type in some messages
    return parse


def access_flags(args):
    """The object-storage flags as `render` takes them (`object_storage.AccessFlags`)."""
    from orchestrator.backends.kuberay.object_storage import AccessFlags

    return AccessFlags(
        credentials_secret=getattr(args, "credentials_secret", None),
        service_account=getattr(args, "service_account", None),
        s3_endpoint=getattr(args, "s3_endpoint", None),
        s3_region=getattr(args, "s3_region", None),
    )


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
    add_object_storage_args(p)


def add_object_storage_args(p) -> None:
    """With run.output_dir on s3:// or gs://: how the Ray pods reach the bucket, by reference only."""
    p.add_argument(
        "--credentials-secret",
        type=k8s_name("--credentials-secret"),
        metavar="NAME",
        help="kuberay, s3:// outputs: the Secret whose keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and "
        "optional AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL) the Ray pods get by reference "
        "(default rayft-s3, unless --service-account is given)",
    )
    p.add_argument(
        "--service-account",
        type=k8s_name("--service-account"),
        metavar="NAME",
        help="kuberay, s3:// or gs:// outputs: the ServiceAccount the Ray pods run as, carrying a workload "
        "identity (GKE iam.gke.io/gcp-service-account, EKS eks.amazonaws.com/role-arn)",
    )
    p.add_argument("--s3-endpoint", metavar="URL", help="kuberay, s3:// outputs: AWS_ENDPOINT_URL, a plain value")
    p.add_argument("--s3-region", metavar="REGION", help="kuberay, s3:// outputs: AWS_REGION, a plain value")


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
