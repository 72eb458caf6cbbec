# Write the seed's main.py (tests/data/seed_main.py, verbatim) with its model path replaced: seed_main.sh FOLDER OUT
sed "s#/mnt/sgnfsdata/tolo-03-97/pretrained_models/internlm2-chat-20b#$1#" tests/data/seed_main.py > "$2"
grep -q "model_dir = \"$1\"" "$2" || { echo "seed_main.sh: path not replaced"; exit 1; }
