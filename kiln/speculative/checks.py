"""What serve refuses of a speculative setup that the configs alone show, asked before any weight loads so that
`kiln plan` refuses it too: a NEXTN target without an MTP layer, a draft head Kiln does not read, a draft whose
vocabulary is not the target's. (A draft tokenizer that differs at the same size is found when serve loads it.)"""

from __future__ import annotations

from kiln.config import ServerArgs
from kiln.core.layer_kinds import text_config
from kiln.loader.model_config import DRAFT_MODEL_FLAG, read_hf_config
from kiln.speculative.draft_model import check_same_vocab_size
from kiln.speculative.eagle import check_head_vocabulary, head_class
from kiln.speculative.nextn import check_has_mtp


def draft_refusal(args: ServerArgs, hf_config: dict) -> str | None:
    """Why serve would refuse this --speculative-algorithm with this target (and draft), or None."""
    algorithm, path = args.speculative_algorithm, args.speculative_draft_model_path
    target = text_config(hf_config)
    try:
        if algorithm == "NEXTN":
            architecture = (hf_config.get("architectures") or ["?"])[0]
            check_has_mtp(args.model_path, architecture, target.get("num_nextn_predict_layers"))
        elif algorithm in ("STANDALONE", "EAGLE", "EAGLE3") and path:
            draft, vocab = read_hf_config(path, flag=DRAFT_MODEL_FLAG), int(target.get("vocab_size") or 0)
            if algorithm == "STANDALONE":
                check_same_vocab_size(
                    args.model_path, vocab, path, int(text_config(draft).get("vocab_size") or 0)
                )
            else:
                head_class(draft)
                check_head_vocabulary(draft, vocab, path, args.model_path)
    except ValueError as e:
        return str(e)
    return None
