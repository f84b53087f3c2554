"""Convert megalite checkpoints to Hugging Face model folders and back.

    # a checkpoint of any layout -> a folder transformers loads (Llama, Qwen2, Qwen3 or GPT-2 classes)
    python tools/convert_checkpoint.py to-hf --load runs/default --save hf/tiny [--iteration N]
        [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]

    # a local LLaMA / Mistral / Qwen2 / Qwen3 / GPT-2 folder -> a megalite checkpoint (iteration 0) to train on
    python tools/convert_checkpoint.py from-hf --load hf/TinyLlama --save ckpt/tinyllama \
        [--tensor-model-parallel-size 2] [--seq-length 2048]

to-hf streams each tensor from the checkpoint's pieces into its safetensors file
(megalite/convert/export.py), so memory stays near the largest tensor; from-hf refuses
anything megalite would compute differently, naming the config field, and prints the
pretrain_gpt.py flags to continue with `--load <save> --finetune`
(megalite/convert/importer.py). Checkpoints are layout-free: the layout flags only check
that the model can be split that way and pad the vocabulary for that TP size.
"""

import argparse
import sys

from megalite.convert import DTYPES, export_checkpoint, import_checkpoint
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.errors import run_main


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("to-hf", help="megalite checkpoint -> Hugging Face folder")
    export.add_argument("--load", required=True, metavar="DIR", help="checkpoint folder (a run's --save)")
    export.add_argument("--iteration", type=int, metavar="N", help="default: the latest checkpoint")
    export.add_argument("--save", required=True, metavar="DIR", help="the Hugging Face folder to write")
    export.add_argument("--dtype", choices=DTYPES, help="weight dtype; default: as stored in the checkpoint")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="split weights into files of at most this size (e.g. 5GB, 500MB); default 5GB")
    export.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="default: the run's")
    export.add_argument("--tokenizer-model", metavar="PATH", help="default: the run's (give it when the file moved)")
    export.add_argument("--skip-tokenizer", action="store_true", help="write the model only")
    export.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    load = commands.add_parser("from-hf", help="Hugging Face folder -> megalite checkpoint (iteration 0)")
    load.add_argument("--load", required=True, metavar="DIR",
                      help="local Hugging Face model folder (config.json + safetensors)")
    load.add_argument("--save", required=True, metavar="DIR", help="checkpoint folder to create")
    load.add_argument("--tensor-model-parallel-size", type=int, metavar="N", default=1,
                      help="checks that heads, groups and FFN split this way and pads the vocabulary for it; "
                           "the checkpoint still loads at any layout")
    load.add_argument("--pipeline-model-parallel-size", type=int, metavar="N", default=1,
                      help="checks that the layers split over this many stages")
    load.add_argument("--seq-length", type=int, metavar="N",
                      help="training sequence length to record; default max_position_embeddings, at most 4096")
    load.add_argument("--make-vocab-size-divisible-by", type=int, metavar="N", default=128,
                      help="vocabulary padding, as pretrain_gpt.py's flag of that name (default 128)")
    load.add_argument("--dtype", choices=DTYPES, help="weight dtype; default: as stored in the HF files")
    load.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv) -> None:
    args = parse_args(argv)
    if args.command == "to-hf":
        export_checkpoint(args.load, args.save, args.iteration, DTYPES.get(args.dtype), args.max_shard_size,
                          args.tokenizer_type, args.tokenizer_model, args.skip_tokenizer)
    else:
        import_checkpoint(args.load, args.save, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                          args.seq_length, args.make_vocab_size_divisible_by, DTYPES.get(args.dtype))


if __name__ == "__main__":
    sys.exit(run_main(main))
