"""What serve refuses of a speculative setup that the configs alone show, asked before any weight loads so that
`kiln plan` refuses it too: a NEXTN target without an MTP layer, a draft head Kiln does not read, a draft whose
vocabulary is not the target's. (A draft tokenizer that differs at the same size is found when serve loads it.)"""

from __future__ import annotations

from kiln.config import ServerArgs
from kiln.loader.model_config import DRAFT_MODEL_FLAG, read_model_spec
from kiln.models.spec import ModelSpec
from kiln.speculative.draft_model import check_same_vocab_size
from kiln.speculative.eagle import check_head_vocabulary, head_class
from kiln.speculative.nextn import check_has_mtp


def draft_refusal(args: ServerArgs, target: ModelSpec) -> str | None:
    """Why serve would refuse this --speculative-algorithm with this target (and draft), or None."""
    algorithm, path = args.speculative_algorithm, args.speculative_draft_model_path
    try:
        if algorithm == "NEXTN":
            check_has_mtp(args.model_path, target.architecture or "?", target.nextn_layers)
        elif algorithm in ("STANDALONE", "EAGLE", "EAGLE3") and path:
            draft = read_model_spec(path, flag=DRAFT_MODEL_FLAG)
            if algorithm == "STANDALONE":
                check_same_vocab_size(args.model_path, target.vocab_size, path, draft.vocab_size)
            else:
                head_class(draft.architecture)
                check_head_vocabulary(draft.vocab_size, target.vocab_size, path, args.model_path)
    except ValueError as e:
        return str(e)
    return None
