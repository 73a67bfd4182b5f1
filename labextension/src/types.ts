/**
 * Wire objects of LMSP 1.0 as the sidebar reads them (see docs/protocol.md and
 * jupyter_lmsp/protocol/objects.py). Only the fields the sidebar uses are typed.
 */

export interface IList<T> {
  object: 'list';
  data: T[];
  has_more?: boolean;
}

export interface IWorkerInfo {
  state: string;
  pid?: number;
  blas?: string;
  last_exit_code?: number | null;
}

export interface IService {
  object: 'service';
  id: string;
  name: string;
  protocol: string;
  version: string;
  capabilities: string[];
  default_model: string | null;
  worker?: IWorkerInfo;
}

export type TaskState =
  | 'queued'
  | 'loading'
  | 'running'
  | 'cancelling'
  | 'completed'
  | 'failed'
  | 'cancelled';

export interface IErrorObject {
  type?: string;
  code?: string | null;
  message: string;
  param?: string | null;
}

export interface ITask {
  id: string;
  object: 'task';
  kind: string;
  state: TaskState;
  model: string | null;
  response_id: string | null;
  owner: string | null;
  error: IErrorObject | null;
  last_sequence_number: number;
  created_at: number;
  updated_at: number;
  finished_at: number | null;
}

/** One event of a task's log; lifecycle events of a response carry `response`. */
export interface ITaskEvent {
  type: string;
  sequence_number: number;
  delta?: string;
  response?: {
    status?: string;
    usage?: { output_tokens?: number } | null;
    max_output_tokens?: number | null;
  };
  [key: string]: unknown;
}

export interface IModel {
  id: string;
  object: 'model';
  created: number;
  format?: string;
  path?: string;
  size_bytes?: number;
  digest?: string;
  state?: string;
}

export interface IPairing {
  id: string;
  object: 'pairing';
  client_name: string;
  requested_scopes: string[];
  granted_scopes: string[] | null;
  user_code: string;
  status: string;
  client_id: string | null;
  created_at: number;
  expires_at: number;
}

export interface IClient {
  id: string;
  object: 'client';
  name: string;
  scopes: string[];
  created_at: number;
  last_used_at: number | null;
  revoked_at: number | null;
}
