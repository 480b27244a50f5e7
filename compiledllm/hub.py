"""Models by Hugging Face name: ORG/NAME resolves to its snapshot in huggingface_hub's cache, downloaded there first
if it is missing. Only what the loader reads is downloaded (safetensors weights, config and tokenizer JSON files, at
the repository's top level): never pickles (.bin, .pt) nor code (.py). huggingface_hub's own environment applies
(HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN, proxies), as huggingface_hub reads it when first
imported; its settings are read from huggingface_hub.constants at each call. Offline, only the cache is read.
huggingface_hub is imported only here and only for a Hub name, so a process that never names one never needs it.
Every failure is one line naming the model."""
from __future__ import annotations

import re
from pathlib import Path

from compiledllm import __version__
from compiledllm.errors import UserError

ALLOW_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                  "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"]
IGNORE_PATTERNS = ["*/*"]  # the loader reads the top level only: "*.safetensors" alone would match sub/x.safetensors
EXAMPLE = "inclusionAI/LLaDA2.0-mini"
REPO_ID = re.compile(r"[\w.-]{1,96}/[\w.-]{1,96}")  # huggingface_hub's shape, when it is not installed to ask


def brief(e: BaseException, limit: int) -> str:
    """`e` as one line of at most `limit` characters (tokenizer.one_line's rule; that module imports torch and the
    tokenizers, which a failing Hub lookup must not wait for)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_repo_id(name: str) -> bool:
    """Whether `name` is shaped as a Hub model id ORG/NAME, by huggingface_hub's rules for the characters."""
    if name.count("/") != 1:  # huggingface_hub also takes a bare NAME, which reads as a local path here
        return False
    try:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # snapshot() then says what to install
        return REPO_ID.fullmatch(name) is not None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def parse_revision(revision: object) -> str | None:
    """A Hub revision (branch, tag or commit) or None; anything else, or a blank string, is a UserError."""
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise UserError(f"model.revision: expected a branch, tag or commit of the Hub repository, got {revision!r}")
    return revision


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cache snapshot of Hub model `repo_id` at `revision` (default: main), downloading what is missing."""
    at = repo_id + (f" (revision {revision})" if revision else "")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as e:
        raise UserError(f"{at}: not a local directory, and a Hugging Face model name needs the huggingface_hub "
                        f"package ({brief(e, 120)}): pip install huggingface_hub") from None
    # read at call time, so that the lookup, the download and the messages agree on one cache and one mode
    offline, cache = constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE
    download = f"download it first (`hf download {repo_id}" + (f" --revision {revision}" if revision else "") + "`)"
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                      allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
                                      library_name="compiledllm", library_version=__version__))
    except LocalEntryNotFoundError as e:  # not (completely) in the cache, and the Hub is not asked or not reached
        if offline:
            raise UserError(f"{at}: not a local directory, and not (completely) in the Hugging Face cache "
                            f"{cache} while HF_HUB_OFFLINE is set: {download} or unset "
                            "HF_HUB_OFFLINE") from None
        cause = e.__cause__ or e
        raise UserError(f"{at}: not a local directory, not (completely) in the Hugging Face cache {cache}, and "
                        f"the Hub cannot be reached ({type(cause).__name__}: {brief(cause, 160)}); check the "
                        "network (HF_ENDPOINT, HTTPS_PROXY) or " + download) from None
    except GatedRepoError:
        raise UserError(f"{at}: a gated model: accept its terms at {constants.ENDPOINT}/{repo_id} and log in "
                        "(`hf auth login`, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UserError(f"{at}: not a local directory, and no model of that name on the Hugging Face Hub (a private "
                        "one needs `hf auth login`, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise UserError(f"{repo_id}: the Hub repository has no revision {revision!r}") from None
    except HfHubHTTPError as e:
        raise UserError(f"{at}: the Hugging Face Hub refused the download ({brief(e, 200)})") from None
    except Exception as e:  # the HTTP client's own transport errors mid-download, a full disk, a cache not writable
        raise UserError(f"{at}: downloading from the Hugging Face Hub failed ({type(e).__name__}: "
                        f"{brief(e, 200)})") from None


def _repo_blob(real: Path, root: Path) -> bool:
    """Whether the resolved path `real` is ROOT/models--ORG--NAME/blobs/FILE, huggingface_hub's layout."""
    repo = real.parent.parent
    return real.parent.name == "blobs" and repo.name.startswith("models--") and repo.parent == root


def is_cache_blob(real: Path, checkpoint: Path) -> bool:
    """Whether `real`, a resolved weight file that lies outside `checkpoint`, is a blob of a Hugging Face cache
    that the checkpoint's links may point into: the cache huggingface_hub uses (constants.HF_HUB_CACHE, where its
    snapshots and `--local-dir` downloads link), or the cache `checkpoint` is itself a snapshot of (ROOT/
    models--ORG--NAME/snapshots/REV, e.g. a `--cache-dir` download), and then only that repository's blobs. The
    paths are compared resolved, so a folder merely named like a cache elsewhere is no exception."""
    snap = checkpoint.resolve()
    if snap.parent.name == "snapshots" and real.parent == snap.parent.parent / "blobs":
        return _repo_blob(real, snap.parent.parent.parent)
    try:
        from huggingface_hub import constants
    except ImportError:  # no huggingface_hub: no cache of its own to trust
        return False
    return _repo_blob(real, Path(constants.HF_HUB_CACHE).resolve())
