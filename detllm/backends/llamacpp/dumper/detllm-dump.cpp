// detllm-dump: run one sequence through libllama and write the raw tensors of chosen graph nodes
// at one decode step, through libllama's eval callback (llama_context_params.cb_eval).
// Built by scripts/build_llamacpp.sh as an extra target of the same pinned llama.cpp build.
//
//   detllm-dump -m MODEL.gguf --tokens 1,2,3 --step S --out DIR [--forced 7,8] [--match REGEX]... [--skip REGEX]...
//               [--skip-op OP]... [--tokens 1,2;3,4,5 --forced 7,8,9;6,6,6 --row R]
//               [--graft NAME --graft-file F --graft-pos P,... [--graft-op OP]]
//               [-t N] [-tb N] [-c N] [-np N] [-b N] [-ub N] [-fa on|off|auto] [-ctk T] [-ctv T] [-v]
//
// Step 0 is the prompt's forward (it yields generated token 0); step k > 0 feeds generated token
// k-1 (from --forced if given, else the greedy argmax) and yields token k. Only the forward of
// step S is captured; the steps before it run with the callback declining every node. A captured
// node ends a graph view (ggml_backend_sched computes up to it, then calls back), so RMS_NORM nodes
// are never captured: the CPU backend fuses RMS_NORM with the MUL after it, and a cut between them
// would change the bits of the step. Their MUL (e.g. attn_norm-N) is captured instead.
//
// DIR/tensors.bin: the captured tensors, float32, contiguous, ggml order (ne[0] fastest), back to back.
// DIR/logits.bin:  the last row's logits at each step 0..S, float32 [S+1][n_vocab].
// DIR/index.json:  {"format": "detllm-dump", "version": 2, ..., "evals": [[first position, tokens], ...], "rows", "graft",
//                  "tensors": [{"name", "op", "type", "ne", "eval", "order", "offset", "nbytes",
//                               "src": [{"name", "op", "type", "ne", "src": [names]}]}]}
//                  "eval" indexes "evals": the prompt is decoded one ubatch per llama_decode (chunks of
//                  -b split by -ub, as llama_decode splits one sequence), so each is one graph evaluation.
// A tensor of a type that is not f32/f16/bf16/i32 is listed with "offset": null (no data).
//
// A batch (--tokens A;B;...; --forced G_A;G_B;... the tokens each sequence generated; --row R): the
// sequences run as llama-server's update_slots batches its slots (slot i = sequence i): each server
// iteration one llama_batch, first the sampled token of every generating slot, then the prompt tokens of
// the slots still processing, in slot order, up to -b tokens; each batch split into the ubatches
// llama_decode makes of it (split_equal, ported below) and each ubatch decoded by its own llama_decode,
// so every graph evaluation is known. The captured step is row R's step S; "rows" gives, per
// evaluation, [sequence, position, output] of each row, and logits.bin holds row R's logits.
// --graft NAME --graft-file F --graft-pos P,...: at the captured step, after the first node per
// evaluation whose name is NAME or that reads a tensor named NAME (and whose op is --graft-op, if given)
// is computed, its rows of the captured sequence at those positions are overwritten with F's float32
// rows (one ne[0]-long row per position), before any consumer runs (the node is asked for, so its
// graph split ends there); the node's captured data is the grafted one. index.json's "graft" says
// how many rows and evaluations were written.
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <array>
#include <clocale>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <string>
#include <vector>

namespace {

struct dumper {
    std::vector<std::regex> patterns;  // empty: every node
    std::vector<std::regex> skips;     // never these names (e.g. reshapes of captured nodes)
    std::vector<std::string> skip_ops; // never these ops (e.g. SET_ROWS: the whole KV cache)
    bool active = false;               // only during the captured step
    FILE * data = nullptr;
    uint64_t offset = 0;
    int eval = 0;                      // graph evaluation (ubatch) of the captured step, set by main's loop
    std::string evals;                 // "[first position, tokens]" of each evaluation of the captured step
    int order = 0;
    std::string index;                 // JSON entries, comma separated
    std::vector<uint8_t> buf;
    std::vector<float> out;
    // which rows each evaluation of the captured step holds ([sequence, position, output]) and whose they are
    std::vector<std::vector<std::array<int, 3>>> rows;
    int row = 0;                       // the sequence captured (and grafted)
    // the graft
    std::string graft, graft_op;
    std::vector<int> graft_pos;
    std::vector<float> graft_val;      // graft_pos.size() rows of graft_width floats
    int64_t graft_width = 0;
    int graft_eval = -1;               // the last evaluation grafted (first matching node per evaluation)
    int graft_rows = 0, graft_evals = 0;
    std::string graft_why;
};

std::string json_str(const char * s) {
    std::string r = "\"";
    for (const char * p = s; *p; ++p) {
        unsigned char c = (unsigned char) *p;
        if (c == '"' || c == '\\') { r += '\\'; r += (char) c; }
        else if (c < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", c); r += b; }
        else r += (char) c;
    }
    return r + "\"";
}

std::string ne_json(const ggml_tensor * t) {
    std::string r = "[";
    for (int i = 0; i < GGML_MAX_DIMS; ++i) {
        r += std::to_string(t->ne[i]);
        if (i + 1 < GGML_MAX_DIMS) r += ", ";
    }
    return r + "]";
}

bool matches(const dumper & d, const ggml_tensor * t) {
    for (const auto & s : d.skips) {
        if (std::regex_search(t->name, s)) return false;
    }
    for (const auto & op : d.skip_ops) {
        if (op == ggml_op_desc(t)) return false;
    }
    if (d.patterns.empty()) return true;
    for (const auto & p : d.patterns) {
        if (std::regex_search(t->name, p)) return true;
    }
    return false;
}

bool convertible(ggml_type type) {
    return type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16 || type == GGML_TYPE_I32;
}

float value_at(const uint8_t * base, ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32:  return *(const float *) base;
        case GGML_TYPE_F16:  return ggml_fp16_to_fp32(*(const ggml_fp16_t *) base);
        case GGML_TYPE_BF16: return ggml_bf16_to_fp32(*(const ggml_bf16_t *) base);
        case GGML_TYPE_I32:  return (float) *(const int32_t *) base;
        default:             return NAN;
    }
}

bool is_graft(const dumper & d, const ggml_tensor * t) {
    if (d.graft.empty() || (!d.graft_op.empty() && d.graft_op != ggml_op_desc(t))) return false;
    if (d.graft == t->name) return true;
    for (int i = 0; i < GGML_MAX_SRC && t->src[i]; ++i) {
        if (d.graft == t->src[i]->name) return true;
    }
    return false;
}

// the captured sequence's rows of this evaluation as the node holds them: every row, or only the output
// rows where the node kept those (llama.cpp's last layer); -1 where the node's row count fits neither
std::vector<int> own_rows(const dumper & d, const ggml_tensor * t, std::vector<int> & pos) {
    std::vector<int> idx;
    pos.clear();
    if (d.eval >= (int) d.rows.size()) return idx;
    const auto & rows = d.rows[d.eval];
    int n_out = 0;
    for (const auto & r : rows) n_out += r[2];
    const bool all = t->ne[1] == (int64_t) rows.size(), outs = !all && t->ne[1] == n_out;
    if (!all && !outs) { idx.push_back(-1); return idx; }
    int k = 0;
    for (const auto & r : rows) {
        if (!all && !r[2]) continue;
        if (r[0] == d.row) { idx.push_back(k); pos.push_back(r[1]); }
        ++k;
    }
    return idx;
}

void write_graft(dumper & d, ggml_tensor * t) {
    d.graft_eval = d.eval;
    if (t->type != GGML_TYPE_F32 || !ggml_backend_buffer_is_host(t->buffer) || t->ne[2] != 1 || t->ne[3] != 1) {
        d.graft_why = std::string("node ") + t->name + " is not a 2-d float32 tensor in host memory";
        return;
    }
    if (t->ne[0] != d.graft_width) {
        d.graft_why = std::string("node ") + t->name + " has rows of " + std::to_string(t->ne[0]) + " values, the graft " +
                      std::to_string(d.graft_width);
        return;
    }
    std::vector<int> pos;
    const std::vector<int> idx = own_rows(d, t, pos);
    if (!idx.empty() && idx[0] < 0) { d.graft_why = std::string("node ") + t->name + "'s rows match no row layout"; return; }
    int written = 0;
    for (size_t i = 0; i < idx.size(); ++i) {
        const auto it = std::find(d.graft_pos.begin(), d.graft_pos.end(), pos[i]);
        if (it == d.graft_pos.end()) continue;
        const float * src = d.graft_val.data() + (size_t) (it - d.graft_pos.begin()) * d.graft_width;
        uint8_t * dst = (uint8_t *) t->data + (size_t) idx[i] * t->nb[1];
        for (int64_t j = 0; j < t->ne[0]; ++j) *(float *) (dst + j * t->nb[0]) = src[j];
        ++written;
    }
    d.graft_rows += written;
    d.graft_evals += written > 0;
}

bool on_eval(ggml_tensor * t, bool ask, void * user_data) {
    auto * d = (dumper *) user_data;
    if (!d->active) {
        return ask ? false : true;  // declined nodes are not called back; true keeps computing
    }
    if (ask) {
        // never an RMS_NORM: stopping after it would split the RMS_NORM+MUL pair the CPU backend
        // fuses into one kernel, and the captured step would compute other bits than a plain run
        return t->op != GGML_OP_RMS_NORM && (matches(*d, t) || (d->graft_eval != d->eval && is_graft(*d, t)));
    }
    if (d->graft_eval != d->eval && is_graft(*d, t)) write_graft(*d, t);  // before the copy: the record is the grafted node
    if (!matches(*d, t)) return true;  // asked for the graft only

    std::string entry = "{\"name\": " + json_str(t->name) + ", \"op\": " + json_str(ggml_op_desc(t)) +
                        ", \"type\": " + json_str(ggml_type_name(t->type)) + ", \"ne\": " + ne_json(t) +
                        ", \"eval\": " + std::to_string(d->eval) + ", \"order\": " + std::to_string(d->order++);
    if (convertible(t->type) && t->data != nullptr) {
        const size_t n_bytes = ggml_nbytes(t);
        const uint8_t * src = (const uint8_t *) t->data;
        if (!ggml_backend_buffer_is_host(t->buffer)) {
            d->buf.resize(n_bytes);
            ggml_backend_tensor_get(t, d->buf.data(), 0, n_bytes);
            src = d->buf.data();
        }
        const int64_t n = ggml_nelements(t);
        d->out.resize((size_t) n);
        size_t k = 0;
        for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
            for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
                for (int64_t i1 = 0; i1 < t->ne[1]; ++i1)
                    for (int64_t i0 = 0; i0 < t->ne[0]; ++i0)
                        d->out[k++] = value_at(src + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3], t->type);
        const size_t bytes = (size_t) n * sizeof(float);
        if (fwrite(d->out.data(), 1, bytes, d->data) != bytes) {
            fprintf(stderr, "detllm-dump: error: writing tensors.bin failed\n");
            exit(1);
        }
        entry += ", \"offset\": " + std::to_string(d->offset) + ", \"nbytes\": " + std::to_string(bytes);
        d->offset += bytes;
    } else {
        entry += ", \"offset\": null, \"nbytes\": 0";
    }
    entry += ", \"src\": [";
    for (int i = 0; i < GGML_MAX_SRC && t->src[i]; ++i) {
        const ggml_tensor * s = t->src[i];
        if (i) entry += ", ";
        entry += "{\"name\": " + json_str(s->name) + ", \"op\": " + json_str(ggml_op_desc(s)) +
                 ", \"type\": " + json_str(ggml_type_name(s->type)) + ", \"ne\": " + ne_json(s) + ", \"src\": [";
        for (int k = 0; k < GGML_MAX_SRC && s->src[k]; ++k) {  // one level further: a norm's input is its RMS_NORM's
            entry += (k ? ", " : "") + json_str(s->src[k]->name);
        }
        entry += "]}";
    }
    entry += "]}";
    if (!d->index.empty()) d->index += ",\n  ";
    d->index += entry;
    return true;
}

[[noreturn]] void usage_error(const std::string & msg) {
    fprintf(stderr, "detllm-dump: error: %s\n", msg.c_str());
    exit(2);
}

std::vector<llama_token> parse_ids(const std::string & s) {
    std::vector<llama_token> ids;
    size_t i = 0;
    while (i < s.size()) {
        size_t j = s.find(',', i);
        if (j == std::string::npos) j = s.size();
        std::string item = s.substr(i, j - i);
        char * end = nullptr;
        long v = strtol(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || v < 0 || v > INT32_MAX) usage_error("bad token id '" + item + "'");
        ids.push_back((llama_token) v);
        i = j + 1;
    }
    return ids;
}

std::vector<std::vector<llama_token>> parse_seqs(const std::string & s) {
    std::vector<std::vector<llama_token>> seqs;
    size_t i = 0;
    while (true) {
        size_t j = s.find(';', i);
        const std::string part = s.substr(i, j == std::string::npos ? std::string::npos : j - i);
        seqs.push_back(part.empty() ? std::vector<llama_token>() : parse_ids(part));
        if (j == std::string::npos) break;
        i = j + 1;
    }
    return seqs;
}

// the ubatches llama_decode makes of one batch on a non-unified KV cache of several streams
// (llama_batch_allocr::split_equal(n_ubatch, sequential = true, n_keep_tail = 0) at the pinned version,
// for tokens of one sequence each): per ubatch the batch indices, sequence by sequence
std::vector<std::vector<int>> split_equal(const std::vector<int> & seq, int n_ubatch) {
    std::vector<std::vector<int>> out;
    std::vector<bool> used(seq.size(), false);
    size_t n_used = 0;
    while (n_used < seq.size()) {
        std::vector<int> cur;  // sequence ids, increasing by one
        for (size_t i = 0; i < seq.size(); ++i) {
            if (used[i] || std::find(cur.begin(), cur.end(), seq[i]) != cur.end()) continue;
            if (!cur.empty() && seq[i] != cur.back() + 1) continue;
            cur.push_back(seq[i]);
            if ((int) cur.size() > n_ubatch) break;
        }
        const size_t n_seqs = cur.size();
        std::vector<std::vector<int>> per(n_seqs), left(n_seqs);
        for (size_t s = 0; s < n_seqs; ++s)
            for (size_t i = 0; i < seq.size(); ++i)
                if (!used[i] && seq[i] == cur[s]) left[s].push_back((int) i);
        std::vector<size_t> at(n_seqs, 0);
        while (true) {
            bool can = true;
            for (size_t s = 0; s < n_seqs; ++s) can = can && at[s] < left[s].size();
            if (!can) break;
            for (size_t s = 0; s < n_seqs; ++s) {
                const int idx = left[s][at[s]++];
                per[s].push_back(idx);
                used[idx] = true;
                ++n_used;
            }
            if ((per[0].size() + 1) * n_seqs > (size_t) n_ubatch) break;
        }
        std::vector<int> ub;
        for (const auto & p : per) ub.insert(ub.end(), p.begin(), p.end());
        out.push_back(ub);
    }
    return out;
}

int parse_int(const std::string & flag, const char * v, int lo) {
    char * end = nullptr;
    long x = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < lo || x > INT32_MAX) usage_error(flag + " takes an integer >= " + std::to_string(lo));
    return (int) x;
}

ggml_type parse_type(const std::string & flag, const std::string & v) {
    for (int i = 0; i < GGML_TYPE_COUNT; ++i) {
        const char * name = ggml_type_name((ggml_type) i);
        if (name && v == name) return (ggml_type) i;
    }
    usage_error(flag + ": unknown type '" + v + "'");
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

}  // namespace

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    std::string model_path, out_dir;
    std::vector<llama_token> prompt, forced;
    std::vector<std::vector<llama_token>> prompts, gens;  // a batch: every sequence's prompt and generated tokens
    std::string graft_file;
    int step = -1, threads = 1, threads_batch = -1, n_ctx = 1024, n_seq = 1, n_batch = 2048, n_ubatch = 512;
    llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_AUTO;
    ggml_type type_k = GGML_TYPE_F16, type_v = GGML_TYPE_F16;
    bool verbose = false;
    dumper d;

    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto next = [&]() -> const char * {
            if (i + 1 >= argc) usage_error(a + " needs a value");
            return argv[++i];
        };
        if (a == "-m") model_path = next();
        else if (a == "--tokens") prompts = parse_seqs(next());
        else if (a == "--forced") gens = parse_seqs(next());
        else if (a == "--row") d.row = parse_int(a, next(), 0);
        else if (a == "--graft") d.graft = next();
        else if (a == "--graft-op") d.graft_op = next();
        else if (a == "--graft-file") graft_file = next();
        else if (a == "--graft-pos") { for (llama_token p : parse_ids(next())) d.graft_pos.push_back((int) p); }
        else if (a == "--step") step = parse_int(a, next(), 0);
        else if (a == "--out") out_dir = next();
        else if (a == "--match") {
            const char * p = next();
            try { d.patterns.emplace_back(p); } catch (const std::regex_error &) { usage_error(std::string("bad --match regex '") + p + "'"); }
        }
        else if (a == "--skip-op") d.skip_ops.emplace_back(next());
        else if (a == "--skip") {
            const char * p = next();
            try { d.skips.emplace_back(p); } catch (const std::regex_error &) { usage_error(std::string("bad --skip regex '") + p + "'"); }
        }
        else if (a == "-t") threads = parse_int(a, next(), 1);
        else if (a == "-tb") threads_batch = parse_int(a, next(), 1);
        else if (a == "-c") n_ctx = parse_int(a, next(), 1);
        else if (a == "-np") n_seq = parse_int(a, next(), 1);
        else if (a == "-b") n_batch = parse_int(a, next(), 1);
        else if (a == "-ub") n_ubatch = parse_int(a, next(), 1);
        else if (a == "-fa") {
            std::string v = next();
            if (v == "on") fa = LLAMA_FLASH_ATTN_TYPE_ENABLED;
            else if (v == "off") fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            else if (v == "auto") fa = LLAMA_FLASH_ATTN_TYPE_AUTO;
            else usage_error("-fa takes on, off or auto");
        }
        else if (a == "-ctk") type_k = parse_type(a, next());
        else if (a == "-ctv") type_v = parse_type(a, next());
        else if (a == "-v") verbose = true;
        else if (a == "-h" || a == "--help") {
            printf("usage: detllm-dump -m MODEL.gguf --tokens IDS[;IDS...] --step S --out DIR [--forced IDS[;IDS...]] [--row R]\n"
                   "                   [--match REGEX]... [--skip REGEX]... [--skip-op OP]... [--graft NAME --graft-file F --graft-pos P,... [--graft-op OP]]\n"
                   "                   [-t N] [-tb N] [-c N] [-np N] [-b N] [-ub N] [-fa on|off|auto] [-ctk T] [-ctv T] [-v]\n");
            return 0;
        }
        else usage_error("unknown argument '" + a + "'");
    }
    const bool batched = prompts.size() > 1;
    if (!batched && !prompts.empty()) prompt = prompts[0];
    if (!batched && !gens.empty()) forced = gens[0];
    if (model_path.empty() || out_dir.empty() || prompts.empty() || prompts[0].empty() || step < 0) {
        usage_error("-m, --tokens, --step and --out are required");
    }
    if (batched) {
        for (const auto & p : prompts) if (p.empty()) usage_error("--tokens: every sequence of a batch needs a token");
        if (gens.size() != prompts.size()) usage_error("--forced gives the generated tokens of " + std::to_string(gens.size()) +
                                                       " sequence(s); --tokens has " + std::to_string(prompts.size()));
        if (d.row >= (int) prompts.size()) usage_error("--row " + std::to_string(d.row) + " is not a sequence of the batch");
        if ((int) gens[d.row].size() < step + 1) usage_error("--forced: sequence " + std::to_string(d.row) + " generated " +
                                                             std::to_string(gens[d.row].size()) + " tokens; step " + std::to_string(step) + " needs " + std::to_string(step + 1));
        if ((int) prompts.size() > n_seq) usage_error("a batch of " + std::to_string(prompts.size()) + " sequences needs -np >= " + std::to_string(prompts.size()));
    } else if (d.row != 0) {
        usage_error("--row is for a batch (several --tokens sequences)");
    }
    if (!d.graft.empty()) {
        FILE * g = graft_file.empty() ? nullptr : fopen(graft_file.c_str(), "rb");
        if (!g || d.graft_pos.empty()) usage_error("--graft needs --graft-file (readable) and --graft-pos");
        float v;
        while (fread(&v, sizeof v, 1, g) == 1) d.graft_val.push_back(v);
        fclose(g);
        if (d.graft_val.empty() || d.graft_val.size() % d.graft_pos.size()) usage_error("--graft-file does not hold one row per --graft-pos");
        d.graft_width = (int64_t) (d.graft_val.size() / d.graft_pos.size());
    }
    if (!forced.empty() && (int) forced.size() < step) {
        usage_error("--forced gives " + std::to_string(forced.size()) + " tokens; step " + std::to_string(step) + " needs " + std::to_string(step));
    }
    if (threads_batch < 0) threads_batch = threads;

    if (!verbose) llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) { fprintf(stderr, "detllm-dump: error: cannot load %s\n", model_path.c_str()); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    for (const auto & seq : prompts) for (llama_token id : seq) if (id >= n_vocab) usage_error("token id " + std::to_string(id) + " is outside the vocabulary");
    for (const auto & seq : gens) for (llama_token id : seq) if (id >= n_vocab) usage_error("token id " + std::to_string(id) + " is outside the vocabulary");

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n_ctx;
    cp.n_batch = (uint32_t) n_batch;
    cp.n_ubatch = (uint32_t) n_ubatch;
    cp.n_seq_max = (uint32_t) n_seq;
    cp.n_threads = threads;
    cp.n_threads_batch = threads_batch;
    cp.flash_attn_type = fa;
    cp.type_k = type_k;
    cp.type_v = type_v;
    cp.kv_unified = false;
    cp.cb_eval = on_eval;
    cp.cb_eval_user_data = &d;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "detllm-dump: error: cannot create a context\n"); return 1; }

    const std::string tensors_path = out_dir + "/tensors.bin", logits_path = out_dir + "/logits.bin";
    d.data = fopen(tensors_path.c_str(), "wb");
    FILE * logits_f = fopen(logits_path.c_str(), "wb");
    if (!d.data || !logits_f) { fprintf(stderr, "detllm-dump: error: cannot write into %s\n", out_dir.c_str()); return 1; }

    std::vector<llama_token> fed;  // token fed at steps 1..S
    std::vector<llama_token> argmax;
    llama_batch batch = llama_batch_init(std::max(n_batch, 1), 0, 1);
    int pos = 0;
    for (int s = 0; s <= step && !batched; ++s) {
        std::vector<llama_token> input;
        if (s == 0) input = prompt;
        else input.push_back(forced.empty() ? argmax.back() : forced[s - 1]);
        if (s > 0) fed.push_back(input[0]);
        d.active = (s == step);
        // the prompt in chunks of -b (as llama-server posts it), each in ubatches of -ub (as llama_decode
        // splits one sequence's chunk): one llama_decode per ubatch, so each is one graph evaluation
        for (size_t c0 = 0; c0 < input.size(); c0 += (size_t) n_batch) {
            const size_t c1 = std::min(input.size(), c0 + (size_t) n_batch);
            for (size_t u0 = c0; u0 < c1; u0 += (size_t) n_ubatch) {
                const size_t n = std::min(c1 - u0, (size_t) n_ubatch);
                batch.n_tokens = (int32_t) n;
                if (d.active) {
                    d.evals += (d.evals.empty() ? "[" : ", [") + std::to_string(pos) + ", " + std::to_string(n) + "]";
                    d.rows.emplace_back();
                    for (size_t i = 0; i < n; ++i) d.rows.back().push_back({0, pos + (int) i, u0 + i + 1 == input.size()});
                }
                for (size_t i = 0; i < n; ++i) {
                    batch.token[i] = input[u0 + i];
                    batch.pos[i] = pos++;
                    batch.n_seq_id[i] = 1;
                    batch.seq_id[i][0] = 0;
                    batch.logits[i] = (u0 + i + 1 == input.size());
                }
                const int rc = llama_decode(ctx, batch);
                if (rc != 0) { fprintf(stderr, "detllm-dump: error: llama_decode failed at step %d (code %d)\n", s, rc); return 1; }
                if (d.active) d.eval++;
            }
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        if (fwrite(logits, sizeof(float), (size_t) n_vocab, logits_f) != (size_t) n_vocab) {
            fprintf(stderr, "detllm-dump: error: writing logits.bin failed\n");
            return 1;
        }
        int best = 0;
        for (int i = 1; i < n_vocab; ++i) if (logits[i] > logits[best]) best = i;
        argmax.push_back(best);
    }
    if (batched) {
        // llama-server's update_slots, one iteration per loop: the sampled tokens of the generating slots, then
        // prompt tokens, slot by slot, up to n_batch; sampled tokens are the server's own (--forced)
        const int n_seqs = (int) prompts.size();
        std::vector<int> done(n_seqs, 0), sampled(n_seqs, 0);  // prompt tokens processed; tokens sampled
        batch = (llama_batch_free(batch), llama_batch_init(std::max(n_batch, n_seqs), 0, 1));
        prompt = prompts[d.row];
        bool finished = false;
        for (int iter = 0; !finished; ++iter) {
            std::vector<std::array<int, 4>> b;  // [sequence, token, position, output]
            for (int j = 0; j < n_seqs; ++j) {
                if (done[j] == (int) prompts[j].size() && sampled[j] > 0 && sampled[j] < (int) gens[j].size()) {
                    b.push_back({j, gens[j][sampled[j] - 1], (int) prompts[j].size() + sampled[j] - 1, 1});
                }
            }
            for (int j = 0; j < n_seqs && (int) b.size() < n_batch; ++j) {
                while (done[j] < (int) prompts[j].size() && (int) b.size() < n_batch) {
                    b.push_back({j, prompts[j][done[j]], done[j], 0});
                    if (++done[j] == (int) prompts[j].size()) b.back()[3] = 1;
                }
            }
            if (b.empty()) { fprintf(stderr, "detllm-dump: error: the batch ended before row %d reached step %d\n", d.row, step); return 1; }
            // the captured step: row R's prompt (step 0) or the iteration that feeds its token S-1
            d.active = false;
            for (const auto & t : b) {
                if (t[0] == d.row && (step == 0 ? t[2] < (int) prompt.size() : t[2] == (int) prompt.size() + step - 1)) d.active = true;
            }
            if (d.active && step > 0) fed.assign(gens[d.row].begin(), gens[d.row].begin() + step);
            for (size_t off = 0; off < b.size(); off += (size_t) n_batch) {  // the server's views of n_batch tokens
                const size_t n_view = std::min(b.size() - off, (size_t) n_batch);
                std::vector<int> seq;
                for (size_t i = 0; i < n_view; ++i) seq.push_back(b[off + i][0]);
                for (const auto & ub : split_equal(seq, n_ubatch)) {
                    batch.n_tokens = (int32_t) ub.size();
                    if (d.active) d.rows.emplace_back();
                    for (size_t i = 0; i < ub.size(); ++i) {
                        const auto & t = b[off + ub[i]];
                        batch.token[i] = t[1];
                        batch.pos[i] = t[2];
                        batch.n_seq_id[i] = 1;
                        batch.seq_id[i][0] = t[0];
                        batch.logits[i] = t[3];
                        if (d.active) d.rows.back().push_back({t[0], t[2], t[3]});
                    }
                    if (d.active) {
                        int first = -1, n_own = 0;
                        for (const auto & r : d.rows.back()) if (r[0] == d.row) { if (first < 0) first = r[1]; ++n_own; }
                        d.evals += (d.evals.empty() ? "[" : ", [") + std::to_string(first) + ", " + std::to_string(n_own) + "]";
                    }
                    const int rc = llama_decode(ctx, batch);
                    if (rc != 0) { fprintf(stderr, "detllm-dump: error: llama_decode failed at iteration %d (code %d)\n", iter, rc); return 1; }
                    for (size_t i = 0; i < ub.size(); ++i) {
                        const auto & t = b[off + ub[i]];
                        if (!t[3]) continue;
                        const float * logits = llama_get_logits_ith(ctx, (int32_t) i);
                        sampled[t[0]]++;
                        if (t[0] != d.row) continue;
                        if (fwrite(logits, sizeof(float), (size_t) n_vocab, logits_f) != (size_t) n_vocab) {
                            fprintf(stderr, "detllm-dump: error: writing logits.bin failed\n");
                            return 1;
                        }
                        int best = 0;
                        for (int v = 1; v < n_vocab; ++v) if (logits[v] > logits[best]) best = v;
                        argmax.push_back(best);
                        if ((int) argmax.size() == step + 1) finished = true;
                    }
                    if (d.active) d.eval++;
                }
            }
        }
    }
    fclose(d.data);
    fclose(logits_f);

    auto ids_json = [](const std::vector<llama_token> & v) {
        std::string r = "[";
        for (size_t i = 0; i < v.size(); ++i) r += (i ? ", " : "") + std::to_string(v[i]);
        return r + "]";
    };
    std::string rows_json = "[";
    for (size_t e = 0; e < d.rows.size(); ++e) {
        rows_json += e ? ", [" : "[";
        for (size_t i = 0; i < d.rows[e].size(); ++i) {
            const auto & r = d.rows[e][i];
            rows_json += (i ? ", [" : "[") + std::to_string(r[0]) + ", " + std::to_string(r[1]) + ", " + std::to_string(r[2]) + "]";
        }
        rows_json += "]";
    }
    rows_json += "]";
    const std::string graft_json = d.graft.empty() ? "null" :
        "{\"node\": " + json_str(d.graft.c_str()) + ", \"op\": " + json_str(d.graft_op.c_str()) + ", \"rows_written\": " +
        std::to_string(d.graft_rows) + ", \"evals_written\": " + std::to_string(d.graft_evals) + ", \"why\": " +
        (d.graft_why.empty() ? std::string("null") : json_str(d.graft_why.c_str())) + "}";
    const std::string index_path = out_dir + "/index.json";
    FILE * f = fopen(index_path.c_str(), "w");
    if (!f) { fprintf(stderr, "detllm-dump: error: cannot write %s\n", index_path.c_str()); return 1; }
    fprintf(f, "{\"format\": \"detllm-dump\", \"version\": 2, \"model\": %s, \"step\": %d, \"n_vocab\": %d,\n"
               " \"n_embd\": %d, \"n_layer\": %d, \"threads\": %d, \"threads_batch\": %d, \"n_ctx\": %d, \"n_seq_max\": %d,\n"
               " \"n_batch\": %d, \"n_ubatch\": %d, \"flash_attn\": %s, \"type_k\": %s, \"type_v\": %s,\n"
               " \"prompt\": %s, \"fed\": %s, \"argmax\": %s, \"evals\": [%s],\n \"sequences\": %d, \"row\": %d, \"rows\": %s,\n"
               " \"graft\": %s,\n \"tensors\": [\n  %s]}\n",
            json_str(model_path.c_str()).c_str(), step, n_vocab, llama_model_n_embd(model), llama_model_n_layer(model),
            threads, threads_batch, n_ctx, n_seq, n_batch, n_ubatch,
            fa == LLAMA_FLASH_ATTN_TYPE_ENABLED ? "\"on\"" : fa == LLAMA_FLASH_ATTN_TYPE_DISABLED ? "\"off\"" : "\"auto\"",
            json_str(ggml_type_name(type_k)).c_str(), json_str(ggml_type_name(type_v)).c_str(),
            ids_json(prompt).c_str(), ids_json(fed).c_str(), ids_json(argmax).c_str(), d.evals.c_str(),
            (int) prompts.size(), d.row, rows_json.c_str(), graft_json.c_str(), d.index.c_str());
    fclose(f);

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
