// detllm-dump: run one sequence through libllama and write the raw tensors of chosen graph nodes
// at one decode step, through libllama's eval callback (llama_context_params.cb_eval).
// Built by scripts/build_llamacpp.sh as an extra target of the same pinned llama.cpp build.
//
//   detllm-dump -m MODEL.gguf --tokens 1,2,3 --step S --out DIR [--forced 7,8] [--match REGEX]... [--skip REGEX]...
//               [--skip-op OP]...
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
// DIR/index.json:  {"format": "detllm-dump", "version": 1, ..., "evals": [[first position, tokens], ...],
//                  "tensors": [{"name", "op", "type", "ne", "eval", "order", "offset", "nbytes",
//                               "src": [{"name", "op", "type", "ne", "src": [names]}]}]}
//                  "eval" indexes "evals": the prompt is decoded one ubatch per llama_decode (chunks of
//                  -b split by -ub, as llama_decode splits one sequence), so each is one graph evaluation.
// A tensor of a type that is not f32/f16/bf16/i32 is listed with "offset": null (no data).
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
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

bool on_eval(ggml_tensor * t, bool ask, void * user_data) {
    auto * d = (dumper *) user_data;
    if (!d->active) {
        return ask ? false : true;  // declined nodes are not called back; true keeps computing
    }
    if (ask) {
        // never an RMS_NORM: stopping after it would split the RMS_NORM+MUL pair the CPU backend
        // fuses into one kernel, and the captured step would compute other bits than a plain run
        return t->op != GGML_OP_RMS_NORM && matches(*d, t);
    }

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
        else if (a == "--tokens") prompt = parse_ids(next());
        else if (a == "--forced") forced = parse_ids(next());
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
            printf("usage: detllm-dump -m MODEL.gguf --tokens IDS --step S --out DIR [--forced IDS] [--match REGEX]... [--skip REGEX]... [--skip-op OP]...\n"
                   "                   [-t N] [-tb N] [-c N] [-np N] [-b N] [-ub N] [-fa on|off|auto] [-ctk T] [-ctv T] [-v]\n");
            return 0;
        }
        else usage_error("unknown argument '" + a + "'");
    }
    if (model_path.empty() || out_dir.empty() || prompt.empty() || step < 0) {
        usage_error("-m, --tokens, --step and --out are required");
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
    for (llama_token id : prompt) if (id >= n_vocab) usage_error("token id " + std::to_string(id) + " is outside the vocabulary");
    for (llama_token id : forced) if (id >= n_vocab) usage_error("token id " + std::to_string(id) + " is outside the vocabulary");

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
    for (int s = 0; s <= step; ++s) {
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
    fclose(d.data);
    fclose(logits_f);

    auto ids_json = [](const std::vector<llama_token> & v) {
        std::string r = "[";
        for (size_t i = 0; i < v.size(); ++i) r += (i ? ", " : "") + std::to_string(v[i]);
        return r + "]";
    };
    const std::string index_path = out_dir + "/index.json";
    FILE * f = fopen(index_path.c_str(), "w");
    if (!f) { fprintf(stderr, "detllm-dump: error: cannot write %s\n", index_path.c_str()); return 1; }
    fprintf(f, "{\"format\": \"detllm-dump\", \"version\": 1, \"model\": %s, \"step\": %d, \"n_vocab\": %d,\n"
               " \"n_embd\": %d, \"n_layer\": %d, \"threads\": %d, \"threads_batch\": %d, \"n_ctx\": %d, \"n_seq_max\": %d,\n"
               " \"n_batch\": %d, \"n_ubatch\": %d, \"flash_attn\": %s, \"type_k\": %s, \"type_v\": %s,\n"
               " \"prompt\": %s, \"fed\": %s, \"argmax\": %s, \"evals\": [%s],\n \"tensors\": [\n  %s]}\n",
            json_str(model_path.c_str()).c_str(), step, n_vocab, llama_model_n_embd(model), llama_model_n_layer(model),
            threads, threads_batch, n_ctx, n_seq, n_batch, n_ubatch,
            fa == LLAMA_FLASH_ATTN_TYPE_ENABLED ? "\"on\"" : fa == LLAMA_FLASH_ATTN_TYPE_DISABLED ? "\"off\"" : "\"auto\"",
            json_str(ggml_type_name(type_k)).c_str(), json_str(ggml_type_name(type_v)).c_str(),
            ids_json(prompt).c_str(), ids_json(fed).c_str(), ids_json(argmax).c_str(), d.evals.c_str(), d.index.c_str());
    fclose(f);

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
