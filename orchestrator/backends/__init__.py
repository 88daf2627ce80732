"""Where jobs run: `base` (the Backend protocol, JobStatus, the state vocabulary), `ray_jobs`
(a Ray cluster's Jobs API) and `kuberay` (KubeRay RayJobs through the Kubernetes API)."""
