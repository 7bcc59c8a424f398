"""The MaruCache Kubernetes operator.

Pure modules (`models`, `inventory`, `ledger`, `desired`, `conditions`,
`injection`) hold the logic and are tested without a cluster; `k8s` is the
only module that calls the Kubernetes API; `handlers` and `webhook` are thin
kopf glue; `cli` is the composition root.
"""

GROUP = "maru.io"
VERSION = "v1alpha1"
PLURAL = "marucaches"
KIND = "MaruCache"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels and annotations that form the operator's public interface.
LABEL_CACHE = "maru.io/cache"  # on pods: opt in to injection for this cache
LABEL_CXL = "maru.io/cxl"  # on nodes: "true" when DAX devices are attached
LABEL_SHM = "maru.io/shm"  # on nodes: "true" when tmpfs pools may be placed there
ANNOTATION_DAX_DEVICES = "maru.io/dax-devices"  # on nodes: JSON list of {path, size, uuid}
ANNOTATION_SHM_SIZE = "maru.io/shm-size"  # on nodes: tmpfs capacity offered, a quantity
ANNOTATION_INJECTED = "maru.io/injected"  # on pods: the cache a pod was injected for
ANNOTATION_SKIPPED = "maru.io/injection-skipped"  # on pods: why injection was skipped
ANNOTATION_CONTAINER = "maru.io/container"  # on pods: which container runs vLLM
ANNOTATION_PLACEMENT = "maru.io/placement"  # on pods: digest of the pool placement injected
ANNOTATION_REGION = "maru.io/region"  # on pods: the region injected, DEVICE/OFFSET/SIZE (the ledger's drains)
FINALIZER = "maru.io/release-region"
MANAGED_BY = "marucache-operator"
