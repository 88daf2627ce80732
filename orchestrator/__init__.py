"""rayft's driver side, by role: `cli` (every command line), `backends` (where jobs run: the Ray
Jobs API, KubeRay) and `queue` (a persistent queue and the driver that admits its jobs).
Imports flow orchestrator -> tune -> jobs."""
